# Sourced by the recipes (needs $PYTHON): `json_field FILE KEY...` prints the JSON file's field at that key path
# ('' where the file, a key or a value is missing; a list's items, or an object's keys, space-separated).
json_field() {
  $PYTHON - "$@" <<'EOF'
import json, sys
from pathlib import Path
value = json.loads(Path(sys.argv[1]).read_text()) if Path(sys.argv[1]).is_file() else None
for key in sys.argv[2:]:
    value = value.get(key) if isinstance(value, dict) else None
print(" ".join(map(str, value)) if isinstance(value, (list, dict)) else "" if value is None else value)
EOF
}
