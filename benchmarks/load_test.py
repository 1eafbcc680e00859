"""Load test of ``unimae serve`` and a one-model vs two-model RAG comparison.

Part 1 (server): starts ``unimae serve`` on 127.0.0.1 as a subprocess, then ``--clients`` concurrent
clients send requests for ``--duration`` seconds, ``--embed-share`` of them ``/v1/embeddings`` (1-4
STSBenchmark sentences) and the rest ``/v1/completions`` (greedy, ``--max-tokens`` tokens). Reports p50/p99
latency per route, requests/s, the error count (every request is valid, so it must be 0) and the server's
peak RSS (sampled every 0.2 s).

Part 2 (RAG): the same questions answered (a) by ONE model (SmolLM2 [EOS] embeddings retrieve, the same
weights generate, reusing the query's KV cache) and (b) by TWO models (all-MiniLM-L6-v2 retrieves,
SmolLM2 generates), each in its own process: index build time, per-question latency (retrieval and
total), retrieval acc@1 (the question is the first words of a held-out paragraph; hit = that paragraph)
and peak RSS. Corpus: the held-out enwiki-gensim paragraphs (676).

    python benchmarks/load_test.py --adapter runs/unimae/adapter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STSB_RELATIVE = Path("sts/STSBenchmark/test.jsonl")
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "A haiku about rain:"]


class PeakRSS:
    """Samples the RSS of a process and its children every ``every`` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.2):
        self.process, self.every, self.peak = psutil.Process(pid), every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                procs = [self.process, *self.process.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def sentences(data_dir: Path, limit: int = 500) -> list[str]:
    path = data_dir / STSB_RELATIVE
    if not path.is_file():
        return [f"sentence number {i} about a cat and a dog" for i in range(limit)]
    out = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            out.append(json.loads(line)["sentence1"])
            if len(out) == limit:
                break
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def run_clients(base: str, args, texts: list[str]) -> dict:
    latencies: dict[str, list[float]] = {"embeddings": [], "completions": []}
    errors: list[str] = []
    deadline = time.monotonic() + args.duration
    rng = random.Random(0)

    async def client(http: httpx.AsyncClient):
        while time.monotonic() < deadline:
            if rng.random() < args.embed_share:
                route, body = "embeddings", {"input": rng.sample(texts, rng.randint(1, 4))}
            else:
                prompt = rng.choice(PROMPTS)
                route, body = "completions", {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            start = time.perf_counter()
            try:
                response = await http.post(f"{base}/v1/{route}", json=body)
                if response.status_code != 200:
                    errors.append(f"{route} {response.status_code} {response.text[:200]}")
                    continue
            except httpx.HTTPError as err:
                errors.append(f"{route} {type(err).__name__}")
                continue
            latencies[route].append(time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=300) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(args.clients)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "errors": errors, "wall": wall}


def server_load_test(args) -> dict:
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        "from unimae.cli import main; raise SystemExit(main())",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--max-concurrent-generations",
        "1",
        "--merge",  # serving favours speed; see README on the merge trade-off
    ]
    if args.adapter:
        cmd += ["--adapter", args.adapter]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        with PeakRSS(proc.pid) as rss:
            started = time.perf_counter()
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"server exited: {proc.stderr.read()}")
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            startup = time.perf_counter() - started
            idle_rss = rss.peak
            result = asyncio.run(run_clients(base, args, sentences(Path(args.data_dir))))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    routes = {}
    for route, values in result["latencies"].items():
        routes[route] = {
            "requests": len(values),
            "p50_s": round(percentile(values, 50), 3) if values else None,
            "p99_s": round(percentile(values, 99), 3) if values else None,
            "mean_s": round(statistics.mean(values), 3) if values else None,
        }
    total = sum(r["requests"] for r in routes.values())
    return {
        "clients": args.clients,
        "duration_s": args.duration,
        "embed_share": args.embed_share,
        "completion_max_tokens": args.max_tokens,
        "startup_s": round(startup, 1),
        "routes": routes,
        "requests_per_s": round(total / result["wall"], 2),
        "errors": len(result["errors"]),
        "error_samples": result["errors"][:5],
        "idle_rss_gb": round(idle_rss / 1e9, 2),
        "peak_rss_gb": round(rss.peak / 1e9, 2),
    }


def rag_worker(mode: str, args) -> dict:
    """One RAG setup in this process: 'one' (SmolLM2 embeds and answers) or 'two' (MiniLM + SmolLM2)."""
    import numpy as np

    from unimae.corpus import load_passages
    from unimae.encoder import Encoder
    from unimae.generation import GenerationParams, generate_text
    from unimae.index import IndexConfig, VectorIndex
    from unimae.rag import RAG, prompt_tail

    passages = load_passages("enwiki-gensim:heldout")
    rng = random.Random(0)
    chosen = rng.sample(range(len(passages)), args.questions)
    questions = [" ".join(passages[i][1].split()[:12]) for i in chosen]
    params = GenerationParams(max_new_tokens=args.max_tokens)
    load_start = time.perf_counter()
    llm = Encoder.from_pretrained(args.model, adapter=args.adapter if mode == "one" else None, merge=True)
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "one":
            build_start = time.perf_counter()
            index = VectorIndex.build(llm, passages, tmp, IndexConfig())
            build = time.perf_counter() - build_start
            rag = RAG(llm, index)
        else:
            from unimae.evaluation.reference import load_minilm

            minilm = load_minilm()
            build_start = time.perf_counter()

            class MiniLMEncoder:  # the parts of Encoder that VectorIndex and RAG use
                pooling, max_length = "eos", 256
                embedding_dim = minilm.get_sentence_embedding_dimension()

                @staticmethod
                def encode(texts, batch_size=32, normalize=True, show_progress=False):
                    return minilm.encode(texts, batch_size=batch_size, normalize_embeddings=True)

            index = VectorIndex.build(MiniLMEncoder, passages, tmp, IndexConfig())
            build = time.perf_counter() - build_start
        rows, prefill = [], []
        for q, target in zip(questions, chosen, strict=True):
            start = time.perf_counter()
            if mode == "one":
                answer = rag.answer(q, params=params)
                hits, seconds = answer.hits, time.perf_counter() - start
                plain = rag.answer(q, params=params, reuse_kv=False)  # the same question without the cache
                prefill.append(
                    {
                        "ttft_reuse_s": answer.seconds_to_first_token,
                        "ttft_plain_s": plain.seconds_to_first_token,
                        "prompt_tokens": answer.prompt_tokens,
                        "cached_tokens": answer.cached_tokens,
                        "identical": answer.text == plain.text,
                    }
                )
            else:  # the same prompt, without a reusable cache: the retriever is another model
                hits = index.search(np.asarray(MiniLMEncoder.encode([q])), 3)[0]
                ids = llm.prompt_ids(q) + [llm.tokenizer.eos_token_id] + prompt_tail(llm.tokenizer, q, hits)
                generate_text(llm.model, llm.tokenizer, ids, params, precision=llm.precision)
                seconds = time.perf_counter() - start
            rows.append({"seconds": seconds, "hit": hits[0].id == passages[target][0]})
    seconds = [r["seconds"] for r in rows]
    result = {
        "mode": mode,
        "models": "SmolLM2 (embed + generate)" if mode == "one" else "all-MiniLM-L6-v2 + SmolLM2",
        "load_s": round(build_start - load_start, 1),
        "index_build_s": round(build, 1),
        "questions": len(rows),
        "p50_s": round(percentile(seconds, 50), 3),
        "p99_s": round(percentile(seconds, 99), 3),
        "retrieval_acc_at_1": round(sum(r["hit"] for r in rows) / len(rows), 3),
        "peak_rss_gb": round(_max_rss_gb(), 2),
    }
    if prefill:  # time to first token = retrieval done + prefill + first decode step, with and without reuse
        reuse = [p["ttft_reuse_s"] for p in prefill if p["ttft_reuse_s"] is not None]
        plain = [p["ttft_plain_s"] for p in prefill if p["ttft_plain_s"] is not None]
        result["kv_reuse"] = {
            "ttft_p50_reuse_s": round(percentile(reuse, 50), 4),
            "ttft_p50_plain_s": round(percentile(plain, 50), 4),
            "mean_prompt_tokens": round(statistics.mean(p["prompt_tokens"] for p in prefill), 1),
            "mean_cached_tokens": round(statistics.mean(p["cached_tokens"] for p in prefill), 1),
            "identical_answers": sum(p["identical"] for p in prefill),
            "questions": len(prefill),
        }
    return result


def _max_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0, help="Seconds of load.")
    parser.add_argument("--embed-share", type=float, default=0.7, help="Share of embedding requests.")
    parser.add_argument("--max-tokens", type=int, default=16, help="Tokens per completion / RAG answer.")
    parser.add_argument("--questions", type=int, default=20, help="RAG questions per setup.")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-rag", action="store_true")
    parser.add_argument("--data-dir", default=os.environ.get("UNIMAE_DATA", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--output", default=str(RESULTS / "load_test.json"))
    parser.add_argument("--rag-worker", choices=("one", "two"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rag_worker:
        print(json.dumps(rag_worker(args.rag_worker, args)))
        return
    payload = {"model": args.model, "adapter": args.adapter}
    if not args.skip_server:
        payload["server"] = server_load_test(args)
        print(json.dumps(payload["server"], indent=2))
    if not args.skip_rag:
        payload["rag"] = []
        for mode in ("one", "two"):
            cmd = [
                sys.executable,
                __file__,
                "--rag-worker",
                mode,
                "--model",
                args.model,
                "--questions",
                str(args.questions),
                "--max-tokens",
                str(args.max_tokens),
            ]
            if args.adapter:
                cmd += ["--adapter", args.adapter]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            payload["rag"].append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(payload["rag"][-1], indent=2))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
