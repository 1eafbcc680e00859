"""Generation speed: unimae's token loop against llama.cpp (``xllamacpp``) on the same model, in one process.

For each engine, greedy decoding of ``--new-tokens`` tokens (EOS ignored on both sides, so every run has
the same length) after a ~120-token prompt:

- ``tok_s_1``: one stream; completion tokens / seconds from the request to its last token (unimae: through
  the in-flight batching scheduler, a batch of one, as ``unimae serve`` decodes one request);
- ``decode_tok_s_1``: the same run after its first token: (tokens - 1) / (last - first token time);
- ``ttft_s``: the same run's time to its first streamed text;
- ``tok_s_8``: ``--streams`` concurrent requests (different prompts); all their tokens / wall seconds.
  unimae runs them as ``unimae serve`` does: one thread per request calling ``generate_stream`` with the
  in-flight batching scheduler (:class:`unimae.serving.scheduler.GenerationScheduler`, ``--streams`` rows)
  as its token source, so the streams share one batched decode step; ``--no-batching`` runs them as
  independent ``decode_tokens`` loops instead (``serve --no-continuous-batching``); llama.cpp runs them
  in one server with ``--streams`` slots (its continuous batching);
- ``cpu_ms_per_token``: process CPU seconds per generated token (both engines run in this process and
  llama.cpp's threads idle at zero CPU between requests), steadier than wall time on a shared machine.

unimae: ``Encoder.from_pretrained(--model)`` at ``--precision`` (auto: bf16 where the CPU has it, with its
bf16 weights; otherwise on x86 f16-decode: fp32 weights, read as fp16 copies by fbgemm in the decode steps, else
bf16-decode). llama.cpp: the model's
own GGUF (Q4_1 for smollm2-135m) and, where
``unimae.export.gguf`` can write them, the same weights as f16 and q8_0 GGUFs (cached under
``$UNIMAE_CACHE/gguf``). The comparison entry ``llama.cpp`` is the f16 file (16-bit weights like unimae's
bf16) when there is one; every type is reported under ``generation_benchmark.llama_cpp_by_type``. Engines
alternate within each of ``--repeats`` rounds after one warm-up each; medians are reported, and the
unimae / llama.cpp ratios are taken per round (both measured within seconds of each other) and then
their median. Both use ``--threads`` threads (default: all cores this process may use).

    python benchmarks/generation.py                  # writes results/speed.json (other keys kept)
    python benchmarks/generation.py --repeats 1 --new-tokens 16 --streams 2 --types q4_1   # quick check
    python benchmarks/generation.py --emulate-avx2   # as on an AVX2 CPU without native bf16 (see below)

The results record the CPU they ran on (``generation_benchmark.machine``: model, flags, the kernels PyTorch
dispatched, what ``--precision auto`` chose; :func:`unimae.runtime.cpu.cpu_facts`). ``--emulate-avx2`` starts
the benchmark again under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2``
(setting them yourself does the same): PyTorch, oneDNN and fbgemm keep to AVX2, so ``auto`` picks what it picks on
an AVX2 CPU. The ``xllamacpp`` wheel is built for AVX2 only (its ``get_system_info()``), with or without them.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# isort: off
import unimae  # noqa: F401  (first: sets the OpenMP wait policy before torch loads, see unimae.runtime.threads)
import torch

# isort: on

from unimae.files import update_json
from unimae.runtime.cpu import cpu_facts, emulate_avx2
from unimae.runtime.precision import INFERENCE_PRECISIONS

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "results" / "speed.json"
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Sailors knew its "
    "light from far away, and the people of the village told stories about the keepers who had lived "
    "there, each of them alone through the long winters. When the last keeper left, the lamp was replaced "
    "by an automatic one, and the small house next to the tower stayed empty. Children from the village "
    "sometimes climbed the path to look through its dusty windows."
)
ENDINGS = [
    "One morning in spring, a young woman arrived with a suitcase and a key.",
    "Years later, a storm broke every window of the house in one night.",
    "The mayor decided that the house should become a small museum.",
    "A fisherman said he had seen a light moving inside the empty house.",
    "Nobody expected that the tower would be sold at an auction.",
    "The teacher took her class there to learn about the history of the coast.",
    "A painter rented the house for one summer to paint the sea.",
    "Then the automatic lamp stopped working, and the sea was dark again.",
]


@dataclass
class Run:
    """One request: its completion tokens, seconds to the first text and to the end, timestamps."""

    tokens: int
    first: float
    total: float

    def summary(self) -> dict:
        decode = (self.tokens - 1) / (self.total - self.first) if self.total > self.first else None
        return {"tokens": self.tokens, "ttft_s": self.first, "seconds": self.total, "decode_tok_s": decode}


class Unimae:
    """unimae's ``generate_stream`` on an Encoder's model through the server's in-flight batching scheduler,
    one stream and concurrent ones, as ``unimae serve`` runs them: every forward on the scheduler's model
    thread (see :mod:`unimae.runtime.threads`). ``batching`` off: ``decode_tokens`` in each request's thread
    (``serve --no-continuous-batching``)."""

    def __init__(self, encoder, streams: int, batching: bool = True):
        from unimae.serving.scheduler import GenerationScheduler

        self.encoder = encoder
        self.label = f"unimae ({encoder.precision})"
        self.scheduler = None
        if batching:
            self.scheduler = GenerationScheduler(encoder.model, encoder.precision, max_batch=streams)
            self.scheduler.start()

    def run(self, ids: list[int], new_tokens: int) -> Run:
        from unimae.generation.decoding import decode_tokens
        from unimae.generation.sampling import GenerationParams
        from unimae.generation.stream import GenerationResult, generate_stream

        params = GenerationParams(max_new_tokens=new_tokens, ignore_eos=True)
        decode = self.scheduler.decode if self.scheduler is not None else decode_tokens
        start, first, result = time.perf_counter(), None, None
        for item in generate_stream(
            self.encoder.model, self.encoder.tokenizer, ids, params, precision=self.encoder.precision, decode=decode
        ):
            if isinstance(item, GenerationResult):
                result = item
            elif first is None and item:
                first = time.perf_counter() - start
        total = time.perf_counter() - start
        return Run(result.completion_tokens, first if first is not None else total, total)


class LlamaCpp:
    """A llama.cpp server (xllamacpp, in process) with ``slots`` parallel sequences."""

    def __init__(self, gguf: Path, gguf_type: str, threads: int, slots: int, context: int):
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = str(gguf)
        params.n_parallel = slots
        params.n_ctx = context * slots  # split evenly between the slots
        params.cpuparams.n_threads = threads
        params.cpuparams_batch.n_threads = threads
        self.server = xllamacpp.Server(params)
        self.label, self.gguf, self.gguf_type = f"llama.cpp ({gguf_type})", gguf, gguf_type

    def run(self, ids: list[int], new_tokens: int) -> Run:
        body = {
            "prompt": ids,
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,  # no reuse of an earlier request's prompt: every run prefills
            "stream": True,
        }
        start, state = time.perf_counter(), {"first": None, "tokens": 0, "error": None}

        def on_chunk(chunk: dict) -> bool:
            if "choices" not in chunk:
                state["error"] = chunk
                return True
            if state["first"] is None and chunk["choices"][0].get("text"):
                state["first"] = time.perf_counter() - start
            if "usage" in chunk:
                state["tokens"] = chunk["usage"]["completion_tokens"]
            return False

        self.server.handle_completions(body, on_chunk)
        total = time.perf_counter() - start
        if state["error"] is not None:
            raise RuntimeError(f"llama.cpp failed: {state['error']}")
        return Run(state["tokens"], state["first"] if state["first"] is not None else total, total)


def timed(fn):
    """(result, process CPU seconds) of ``fn()``."""
    cpu = time.process_time()
    out = fn()
    return out, time.process_time() - cpu


def single(engine, ids: list[int], new_tokens: int) -> dict:
    run, cpu = timed(lambda: engine.run(ids, new_tokens))
    return {**run.summary(), "tok_s": run.tokens / run.total, "cpu_ms_per_token": 1000 * cpu / run.tokens}


def concurrent(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    runs: list[Run | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            runs[i] = engine.run(prompts[i], new_tokens)
        except BaseException as err:  # reported below, in the main thread
            errors.append(err)

    def all_streams() -> float:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start

    seconds, cpu = timed(all_streams)
    if errors:
        raise errors[0]
    tokens = sum(run.tokens for run in runs)
    return {
        "streams": len(prompts),
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "cpu_ms_per_token": 1000 * cpu / tokens,
        "mean_ttft_s": statistics.mean(run.first for run in runs),
    }


def make_unimae(model: str, precision: str, threads: int, streams: int, batching: bool) -> tuple[Unimae, dict]:
    """(the unimae engine, its facts: precision and the benchmark's prompts, tokenized by its tokenizer)."""
    from unimae.encoder import Encoder

    torch.set_num_threads(threads)
    encoder = Encoder.from_pretrained(model, pooling="eos", precision=precision, max_length=512)
    prompts = [encoder.tokenizer(f"{PARAGRAPH} {ENDINGS[i % len(ENDINGS)]}")["input_ids"] for i in range(streams)]
    return Unimae(encoder, streams, batching), {"precision": encoder.precision, "prompts": prompts}


def make_llamacpp(gguf: Path, gguf_type: str, threads: int, slots: int, context: int) -> tuple[LlamaCpp, dict]:
    return LlamaCpp(gguf, gguf_type, threads, slots, context), {}


def _engine_process(conn, make) -> None:
    """A child process: build the engine with ``make()``, then answer ('warmup' | 'round', prompts, tokens)."""
    engine, facts = make()
    conn.send({"label": engine.label, **facts})
    while (message := conn.recv()) is not None:
        kind, prompts, new_tokens = message
        if kind == "warmup":
            engine.run(prompts[0], 4)
            conn.send(None)
        else:
            conn.send(
                {
                    "single": single(engine, prompts[0], new_tokens),
                    "concurrent": concurrent(engine, prompts, new_tokens),
                }
            )


class EngineProcess:
    """One engine in a process of its own (spawned), so that neither engine's OpenMP threads count against the
    other's: torch and llama.cpp share one libgomp in a process, and libgomp stops spinning between parallel
    regions once it manages more threads than there are CPUs (see :mod:`unimae.runtime.threads`). CPU ms per token
    are the engine process's own."""

    def __init__(self, make):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_engine_process, args=(child, make), daemon=True)
        self._process.start()
        self.facts = self._receive()
        self.label = self.facts["label"]

    def _receive(self):
        if not self._conn.poll(1800):
            raise RuntimeError("the engine process did not answer in 30 minutes")
        return self._conn.recv()

    def warm_up(self, prompts: list[list[int]]) -> None:
        self._conn.send(("warmup", prompts, 4))
        self._receive()

    def round(self, prompts: list[list[int]], first: int, new_tokens: int) -> dict:
        """Single stream on ``prompts[first]``, then all ``prompts`` at once."""
        self._conn.send(("round", prompts[first:] + prompts[:first], new_tokens))
        return self._receive()

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(60)


def gguf_file_type(path: Path) -> str:
    """The file type a GGUF declares (``general.file_type``), e.g. 'q4_1' (its embeddings may be q8_0)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields["general.file_type"]
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.lower().removeprefix("mostly_")


def build_ggufs(model: str, types: list[str]) -> dict[str, Path]:
    """{type: GGUF path}: the model's own GGUF (under its type, e.g. q4_1) and the f16/q8_0 files
    ``unimae.export.gguf`` writes from the same weights (cached; skipped with a warning if it cannot)."""
    from unimae.models import cache_root, load_model

    found: dict[str, Path] = {}
    try:
        from unimae.export.gguf import source_gguf, write_gguf
    except ImportError as err:
        logging.warning("no unimae.export.gguf (%s): only the model's own GGUF is compared", err)
        source_gguf, write_gguf = None, None
    source = source_gguf(model) if source_gguf else None
    if source is not None:
        found[gguf_file_type(source)] = source
    wanted = [t for t in types if t not in found]
    if wanted and write_gguf is not None:
        llm, tokenizer, _ = load_model(model, dtype=torch.float32)
        for gguf_type in wanted:
            target = cache_root() / "gguf" / f"bench-{Path(str(source or model)).stem}-{gguf_type}.gguf"
            if not target.is_file():
                logging.warning("writing %s (once)", target)
                try:
                    write_gguf(llm, tokenizer, target, out_type=gguf_type, source=source)
                except (ValueError, RuntimeError, OSError) as err:
                    logging.warning("cannot write a %s GGUF: %s", gguf_type, err)
                    continue
            found[gguf_type] = target
    return {t: found[t] for t in types if t in found}


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds of each engine's single-stream and concurrent figures."""
    one, many = [r["single"] for r in rounds], [r["concurrent"] for r in rounds]
    return {
        "tok_s_1": median([r["tok_s"] for r in one]),
        "tok_s_8": median([r["tok_s"] for r in many]),
        "ttft_s": median([r["ttft_s"] for r in one]),
        "decode_tok_s_1": median([r["decode_tok_s"] for r in one]),
        "cpu_ms_per_token_1": median([r["cpu_ms_per_token"] for r in one]),
        "cpu_ms_per_token_8": median([r["cpu_ms_per_token"] for r in many]),
        "rounds": rounds,
    }


def ratios(ours: list[dict], theirs: list[dict]) -> dict:
    """Median over rounds of unimae / llama.cpp (per-token CPU: llama.cpp / unimae, so > 1 = unimae faster)."""
    pairs = list(zip(ours, theirs, strict=True))
    return {
        "tok_s_1": median([a["single"]["tok_s"] / b["single"]["tok_s"] for a, b in pairs]),
        "decode_tok_s_1": median([a["single"]["decode_tok_s"] / b["single"]["decode_tok_s"] for a, b in pairs]),
        "tok_s_8": median([a["concurrent"]["tok_s"] / b["concurrent"]["tok_s"] for a, b in pairs]),
        "cpu_per_token_1": median(
            [b["single"]["cpu_ms_per_token"] / a["single"]["cpu_ms_per_token"] for a, b in pairs]
        ),
        "ttft_s": median([a["single"]["ttft_s"] / b["single"]["ttft_s"] for a, b in pairs]),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precision", default="auto", choices=INFERENCE_PRECISIONS)
    parser.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="Run again under unimae.runtime.cpu.AVX2_EMULATION (as an AVX2 CPU without native bf16).",
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument(
        "--no-batching", action="store_true", help="unimae's concurrent streams as independent loops (no scheduler)."
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_1"], help="llama.cpp GGUF types")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    return parser.parse_args()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = parse_args()
    if args.emulate_avx2:
        emulate_avx2()
    loadavg_before = os.getloadavg()
    ours = EngineProcess(
        functools.partial(make_unimae, args.model, args.precision, args.threads, args.streams, not args.no_batching)
    )
    prompts, precision = ours.facts["prompts"], ours.facts["precision"]
    context = max(len(p) for p in prompts) + args.new_tokens + 8
    ggufs = build_ggufs(args.model, args.types)
    theirs = [
        EngineProcess(functools.partial(make_llamacpp, path, t, args.threads, args.streams, context))
        for t, path in ggufs.items()
    ]
    engines = [ours, *theirs]
    for engine in engines:  # warm-up: first-call allocations, oneDNN weight packing
        engine.warm_up(prompts)
    rounds: dict[str, list[dict]] = {engine.label: [] for engine in engines}
    for r in range(args.repeats):
        for engine in engines:
            result = engine.round(prompts, r % len(prompts), args.new_tokens)
            rounds[engine.label].append(result)
            print(
                f"round {r + 1}/{args.repeats} {engine.label:22s} 1 stream {result['single']['tok_s']:6.1f} tok/s "
                f"(decode {result['single']['decode_tok_s']:6.1f}, ttft {result['single']['ttft_s']:.3f} s, "
                f"{result['single']['cpu_ms_per_token']:5.1f} CPU ms/token)   {args.streams} streams "
                f"{result['concurrent']['tok_s']:6.1f} tok/s",
                flush=True,
            )
    for engine in engines:
        engine.close()
    machine = {
        **cpu_facts(),
        "cores": len(os.sched_getaffinity(0)),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "note": "load averages above the core count mean other jobs shared the CPU during the run",
    }
    types = list(ggufs)
    reference = "f16" if "f16" in types else (types[0] if types else None)
    summary = {**summarize(rounds[ours.label]), "precision": precision, "threads": args.threads}
    summary.update(cpu_model=machine["cpu_model"], torch_cpu_capability=machine["torch_cpu_capability"])
    update = {"unimae": summary}
    by_type = {}
    for (gguf_type, path), engine in zip(ggufs.items(), theirs, strict=True):
        entry = {**summarize(rounds[engine.label]), "gguf": str(path), "gguf_type": gguf_type}
        entry.update(threads=args.threads, cpu_model=machine["cpu_model"])
        entry["unimae_over_llama_cpp"] = ratios(rounds[ours.label], rounds[engine.label])
        by_type[gguf_type] = entry
    if reference is not None:
        update["llama.cpp"] = by_type[reference]
    update["generation_benchmark"] = {
        "settings": {
            "model": args.model,
            "new_tokens": args.new_tokens,
            "streams": args.streams,
            "unimae_batching": not args.no_batching,
            "repeats": args.repeats,
            "prompt_tokens": [len(p) for p in prompts],
            "greedy": True,
            "ignore_eos": True,
        },
        "machine": machine,
        "llama_cpp_by_type": {t: {k: v for k, v in e.items() if k != "rounds"} for t, e in by_type.items()},
    }
    update_json(args.output, update)
    print(
        f"\nCPU: {machine['cpu_model']} ({machine['cores']} cores, "
        f"load {loadavg_before} -> {machine['loadavg_after']}; "
        f"flags {' '.join(machine['cpu_flags'])}; PyTorch kernels {machine['torch_cpu_capability']}"
        f"{', AVX2 emulated' if machine['avx2_emulated'] else ''})"
    )
    print(f"unimae {precision}: {summary['tok_s_1']:.1f} tok/s, {args.streams} streams {summary['tok_s_8']:.1f}")
    for t, entry in by_type.items():
        ratio = entry["unimae_over_llama_cpp"]
        print(
            f"llama.cpp {t}: {entry['tok_s_1']:.1f} tok/s, {args.streams} streams {entry['tok_s_8']:.1f}; unimae / "
            f"llama.cpp: 1 stream {ratio['tok_s_1']:.2f}, decode {ratio['decode_tok_s_1']:.2f}, "
            f"{args.streams} streams {ratio['tok_s_8']:.2f}, CPU per token {ratio['cpu_per_token_1']:.2f}"
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
