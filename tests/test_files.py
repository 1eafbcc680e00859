"""unimae.files.update_json: extends a shared results file without losing what is there."""

import json

import pytest

from unimae.files import update_json


def test_update_json_keeps_other_keys_and_merges_under_a_key(tmp_path):
    path = tmp_path / "nested" / "speed.json"
    update_json(path, {"unimae": {"tok_s_1": 1.0}})  # creates the folder and the file
    update_json(path, {"llama.cpp": {"tok_s_1": 2.0}})
    update_json(path, {"smollm2": {"s": 7}}, under="train")
    update_json(path, {"gemma3": {"s": 20}}, under="train")
    assert json.loads(path.read_text()) == {
        "unimae": {"tok_s_1": 1.0},
        "llama.cpp": {"tok_s_1": 2.0},
        "train": {"smollm2": {"s": 7}, "gemma3": {"s": 20}},
    }


def test_update_json_refuses_a_malformed_file_and_leaves_it_as_it_was(tmp_path):
    path = tmp_path / "speed.json"
    path.write_text("{broken")
    with pytest.raises(ValueError, match="speed.json is not valid JSON"):
        update_json(path, {"x": 1})
    assert path.read_text() == "{broken"
