"""Load test of ``unimae serve`` (a normal and a hostile mix) and a one-model vs two-model RAG comparison.

Part 1 (server): starts ``unimae serve`` on 127.0.0.1 as a subprocess, then ``--clients`` concurrent
clients send requests for ``--duration`` seconds, ``--embed-share`` of them ``/v1/embeddings`` (1-4
STSBenchmark sentences) and the rest ``/v1/completions`` (greedy, ``--max-tokens`` tokens). Reports p50/p99
latency per route, requests/s, the error count (every request is valid, so it must be 0; a client timeout
of ``--timeout`` s counts as an error) and the server's RSS: idle (after start-up), warm (after one
embedding and one completion), peak (sampled every 0.2 s) and after (once the load has ended and the
server's embedding queue has drained); and the machine's 1-minute load average before and after the load.

``--mix hostile`` adds, among the ``--clients`` (15 by default here) normal ones, ONE client that sends large
embedding requests back to back: ``--big-inputs`` (256) texts of ``--big-tokens`` (512) tokens each (longer
texts, truncated by the server to its max length); at the end of the run it abandons its request in flight (a
client that gives up: the server must drop the rest of that work). The small embedding requests sent while a
large one was in flight are reported on their own (``embeddings_during_large``). Beside them run the hostile
clients of ``hostile_clients.py``: single texts near and over ``--max-body-bytes`` (embeddings, completion,
chat), malformed bodies, ``--half-sent`` connections that stall after half a body (the server's
``--body-timeout-s`` must answer 408), ``--idle-connections`` kept alive after one request (closed by the
server after ``--keep-alive-s``), ``--silent-connections`` that never send a byte (closed after
``--header-timeout-s``), and a client that leaves each streamed completion after its first event. The server is
started with those four limits. Reported
against the targets (``targets``): the server's peak RSS during the load over its idle RSS (<= 1.5), errors
(5xx, or a well-formed request dropped, timed out or not answered 200: 0) and the p99 latency of the small
ordinary requests (the 1-4 sentence embeddings: <= 2 s); each hostile case's outcomes (``hostile``) and the
tracebacks in the server's log. This mix runs the server part only and writes ``results/load-test.json`` unless
``--output`` says otherwise.

Part 2 (RAG): the same questions answered (a) by ONE model (SmolLM2 [EOS] embeddings retrieve, the same
weights generate, reusing the query's KV cache) and (b) by TWO models (all-MiniLM-L6-v2 retrieves,
SmolLM2 generates), each in its own process: index build time, per-question latency (retrieval and
total), retrieval acc@1 (the question is the first words of a held-out paragraph; hit = that paragraph)
and peak RSS. Corpus: the held-out enwiki-gensim paragraphs (676). Retrieval alone is also measured over every
paragraph's question (``all_paragraphs_acc_at_1`` with its binomial standard error: 20 questions cannot separate
two setups), and the two setups are paired on those paragraphs (``rag_paired``: the paragraphs only one of them
finds, and McNemar's exact p).

    python benchmarks/load_test.py --adapter runs/unimae/adapter
    python benchmarks/load_test.py --mix hostile --duration 120

Smoke test of the hostile mix (seconds, small limits; not a measurement):

    python benchmarks/load_test.py --mix hostile --duration 15 --clients 2 --big-inputs 4 --big-tokens 64 \
        --idle-connections 2 --silent-connections 1 --half-sent 1 --body-timeout-s 2 --keep-alive-s 1 \
        --header-timeout-s 2 --max-body-bytes 65536 --settle 0 --output /tmp/load-test-smoke.json
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
from hostile_clients import HostileClients, Limits, summarize

from unimae.adapter import adapter_revision
from unimae.release import resolve_adapter
from unimae.runtime.memory import cpu_model
from unimae.serving.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HOSTILE_OUTPUT = ROOT / "results" / "load-test.json"
RAG_OUTPUT = ROOT / "results" / "rag-benchmark.json"
STSB_RELATIVE = Path("sts/STSBenchmark/test.jsonl")
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "A haiku about rain:"]


class PeakRSS:
    """Samples the RSS of a process and its children every ``every`` seconds in a thread: ``peak`` since the start,
    ``load_peak`` since :meth:`start_load`."""

    def __init__(self, pid: int, every: float = 0.2):
        self.process, self.every, self.peak, self.load_peak = psutil.Process(pid), every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        """RSS of the process and its children now, in bytes."""
        try:
            return sum(p.memory_info().rss for p in [self.process, *self.process.children(recursive=True)])
        except psutil.Error:
            return 0

    def start_load(self) -> int:
        """Start ``load_peak`` from now; the RSS now."""
        self.load_peak = self.now()
        return self.load_peak

    def _run(self):
        while not self._stop.is_set():
            sample = self.now()
            self.peak, self.load_peak = max(self.peak, sample), max(self.load_peak, sample)
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


def big_texts(texts: list[str], count: int, tokens: int) -> list[str]:
    """``count`` texts of well over ``tokens`` tokens (about 6 characters a token: at least 1.5x), so the server
    truncates each to its max length (512 by default): ``count x max_length`` tokens a request."""
    rng = random.Random(1)
    out = []
    for _ in range(count):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < 6 * tokens:
            words += rng.choice(texts).split()
        out.append(" ".join(words))
    return out


async def run_clients(base: str, args, texts: list[str], large: list[str] | None, limits: Limits | None = None) -> dict:
    """``args.clients`` normal clients; with ``large`` one client sending it as one request, back to back; with
    ``limits`` the hostile clients of ``hostile_clients.py`` (their outcomes in ``hostile``)."""
    records: list[tuple[str, float, float]] = []  # (route, start, end) of each request answered 200
    errors: list[str] = []
    abandoned: list[tuple[float, float]] = []  # (start, end) of large requests given up at the deadline
    deadline = time.monotonic() + args.duration
    rng = random.Random(0)

    async def send(http: httpx.AsyncClient, route: str, body: dict, timeout: float, label: str = "") -> None:
        label, start = label or route, time.perf_counter()
        try:
            response = await http.post(f"{base}/v1/{route}", json=body, timeout=timeout)
            if response.status_code != 200:
                errors.append(f"{label} {response.status_code} {response.text[:200]}")
                return
        except httpx.HTTPError as err:
            errors.append(f"{label} {type(err).__name__} after {time.perf_counter() - start:.1f} s")
            return
        records.append((label, start, time.perf_counter()))

    async def client(http: httpx.AsyncClient):
        while time.monotonic() < deadline:
            if rng.random() < args.embed_share:
                route, body = "embeddings", {"input": rng.sample(texts, rng.randint(1, 4))}
            else:
                prompt = rng.choice(PROMPTS)
                route, body = "completions", {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            await send(http, route, body, args.timeout)

    async def hostile(http: httpx.AsyncClient):
        while (left := deadline - time.monotonic()) > 0:
            start = time.perf_counter()
            try:
                await asyncio.wait_for(send(http, "embeddings", {"input": large}, 3600, "embeddings_large"), left)
            except asyncio.TimeoutError:  # the run is over: give up on it, as an impatient client would
                abandoned.append((start, time.perf_counter()))

    others = None
    if limits is not None:
        host, port = base.removeprefix("http://").split(":")
        counts = {"idle": args.idle_connections, "silent": args.silent_connections, "half_sent": args.half_sent}
        others = HostileClients(host, int(port), limits, texts, deadline, counts, args.hostile_pause)
    async with (
        httpx.AsyncClient(timeout=args.timeout) as http,
        httpx.AsyncClient(base_url=base, timeout=args.timeout) as own,  # the hostile ones' own connections
    ):
        start = time.perf_counter()
        clients = [client(http) for _ in range(args.clients)]
        await asyncio.gather(*clients, *([hostile(http)] if large else []), *(others.coroutines(own) if others else []))
        wall = time.perf_counter() - start
    outcomes = others.outcomes if others else []
    return {"records": records, "errors": errors, "abandoned": abandoned, "wall": wall, "hostile": outcomes}


def route_stats(records: list[tuple[str, float, float]], route: str, during=None) -> dict:
    """Latency summary of ``route``'s requests (only those that started inside a ``during`` interval)."""
    values = [
        end - start
        for name, start, end in records
        if name == route and (during is None or any(a <= start < b for a, b in during))
    ]
    summary = {"requests": len(values)}
    for key, q in (("p50_s", 50), ("p99_s", 99)):
        summary[key] = round(percentile(values, q), 3) if values else None
    summary["mean_s"] = round(statistics.mean(values), 3) if values else None
    summary["max_s"] = round(max(values), 3) if values else None
    return summary


def warm_up(base: str) -> None:
    """One embedding and one short completion before the load: the warm RSS includes what the first requests
    allocate for good (measured in-process: the first SmolLM2-135M generation keeps about 0.27 GB)."""
    httpx.post(f"{base}/v1/embeddings", json={"input": "warm up"}, timeout=600).raise_for_status()
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()


def drained(base: str, limit_s: float = 300) -> dict:
    """Wait until the server's embedding queue is empty; its /health (without counters for an older server)."""
    deadline = time.monotonic() + limit_s
    while True:
        health = httpx.get(f"{base}/health", timeout=30).json()
        if health.get("embeddings", {}).get("waiting_requests", 0) == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.5)


def log_summary(text: str) -> dict:
    """The server's log: lines, tracebacks and ERROR lines (the first few of them)."""
    lines = text.splitlines()
    errors = [line for line in lines if line.startswith(("ERROR", "CRITICAL"))]
    return {
        "lines": len(lines),
        "tracebacks": sum(line.startswith("Traceback") for line in lines),
        "error_lines": len(errors),
        "error_samples": [line[:300] for line in errors[:5]],
    }


def targets(peak_over_idle: float | None, errors: int, small_p99: float | None) -> dict:
    """The hostile mix's targets (issue 44) and whether this run met them."""
    out = {
        "load_peak_over_idle_rss": {"target": "<= 1.5", "value": peak_over_idle},
        "errors": {"target": "== 0", "value": errors},
        "small_requests_p99_s": {"target": "<= 2.0", "value": small_p99},
    }
    out["load_peak_over_idle_rss"]["met"] = peak_over_idle is not None and peak_over_idle <= 1.5
    out["errors"]["met"] = errors == 0
    out["small_requests_p99_s"]["met"] = small_p99 is not None and small_p99 <= 2.0
    return out


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
    limits = large = None
    if args.mix == "hostile":
        limits = Limits(
            args.max_body_bytes, ServerConfig.max_inputs, args.body_timeout_s, args.keep_alive_s, args.header_timeout_s
        )
        cmd += ["--max-body-bytes", str(limits.max_body_bytes), "--body-timeout-s", str(limits.body_timeout_s)]
        cmd += ["--keep-alive-s", str(limits.keep_alive_s), "--header-timeout-s", str(limits.header_timeout_s)]
    cmd += args.server_args
    texts = sentences(Path(args.data_dir))
    if args.mix == "hostile":
        large = big_texts(texts, args.big_inputs, args.big_tokens)
    log = tempfile.TemporaryFile("w+")  # read, not piped: a pipe nobody reads stalls a server that logs a lot
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        with PeakRSS(proc.pid) as rss:
            started = time.perf_counter()
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"server exited: {log.read()[-4000:]}")
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            startup = time.perf_counter() - started
            idle_rss = rss.start_load()
            warm_up(base)
            warm_rss = rss.now()
            load_start = os.getloadavg()[0]
            result = asyncio.run(run_clients(base, args, texts, large, limits))
            load_end = os.getloadavg()[0]
            drain_start = time.perf_counter()
            health = drained(base)
            drain = time.perf_counter() - drain_start
            time.sleep(args.settle)  # the batcher hands memory back once its queue is empty
            after_rss = rss.now()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a worker thread still embedding an abandoned request
            proc.kill()
            proc.wait()
        log.seek(0)
        server_log = log_summary(log.read())
        log.close()
    records = result["records"]
    routes = {route: route_stats(records, route) for route in ("embeddings", "completions")}
    if large is not None:
        routes["embeddings_large"] = route_stats(records, "embeddings_large")
        in_flight = [(start, end) for name, start, end in records if name == "embeddings_large"]
        in_flight += result["abandoned"]
        routes["embeddings_during_large"] = route_stats(records, "embeddings", during=in_flight)
    out = {
        "mix": args.mix,
        "clients": args.clients,
        "duration_s": args.duration,
        "embed_share": args.embed_share,
        "completion_max_tokens": args.max_tokens,
        "client_timeout_s": args.timeout,
        "server_args": args.server_args,
        "startup_s": round(startup, 1),
        "routes": routes,
        "requests_per_s": round(len(records) / result["wall"], 2),
        "errors": len(result["errors"]),
        "error_samples": result["errors"][:5],
        "idle_rss_gb": round(idle_rss / 1e9, 3),
        "warm_rss_gb": round(warm_rss / 1e9, 3),
        "peak_rss_gb": round(rss.peak / 1e9, 3),  # from the start, model loading included
        "load_peak_rss_gb": round(rss.load_peak / 1e9, 3),  # from idle on: warm-up and load
        "load_peak_over_idle_rss": round(rss.load_peak / idle_rss, 2) if idle_rss else None,
        "after_rss_gb": round(after_rss / 1e9, 3),
        "after_over_idle_rss": round(after_rss / idle_rss, 2) if idle_rss else None,
        "after_over_warm_rss": round(after_rss / warm_rss, 2) if warm_rss else None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"start": round(load_start, 2), "end": round(load_end, 2)},
        "drain_s": round(drain, 1),
        "server_embedding_counters": health.get("embeddings", {}),
        "server_generation_counters": health.get("generations"),
        "server_log": server_log,
    }
    if large is not None:
        out["large_request"] = {"inputs": args.big_inputs, "tokens_each": args.big_tokens}
        out["large_abandoned_after_s"] = [round(end - start, 1) for start, end in result["abandoned"]]
    if limits is not None:
        hostile = summarize(result["hostile"])
        out["hostile_limits"] = {k: getattr(limits, k) for k in limits.__dataclass_fields__}
        out["hostile_clients"] = {
            "idle_connections": args.idle_connections,
            "silent_connections": args.silent_connections,
            "half_sent": args.half_sent,
            "pause_s": args.hostile_pause,
        }
        out["hostile"] = hostile
        out["errors"] += hostile["errors"]  # a 5xx or a dropped request among the hostile ones too
        out["error_samples"] = (out["error_samples"] + hostile["error_samples"])[:10]
        out["small_requests"] = routes["embeddings"]  # the ordinary 1-4 sentence embedding requests
        small_p99 = routes["embeddings"]["p99_s"]
        out["targets"] = targets(out["load_peak_over_idle_rss"], out["errors"], small_p99)
    return out


def rag_worker(mode: str, args) -> dict:
    """One RAG setup in this process: 'one' (the LLM embeds and answers) or 'two' (MiniLM + the same LLM)."""
    import numpy as np

    from unimae.data.corpus import load_passages
    from unimae.encoder import Encoder
    from unimae.generation.sampling import GenerationParams
    from unimae.generation.stream import generate_text
    from unimae.retrieval.index import IndexConfig, VectorIndex
    from unimae.retrieval.rag import RAG, prompt_tail

    passages = load_passages("enwiki-gensim:heldout")
    rng = random.Random(0)
    chosen = rng.sample(range(len(passages)), args.questions)
    questions = [question_of(passages[i][1]) for i in chosen]
    params = GenerationParams(max_new_tokens=args.max_tokens)
    load_start = time.perf_counter()
    llm = Encoder.from_pretrained(args.model, adapter=args.adapter if mode == "one" else None, merge=True)
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "one":
            build_start = time.perf_counter()
            index = VectorIndex.build(llm, passages, tmp, IndexConfig())
            build = time.perf_counter() - build_start
            rag = RAG(llm, index)
            every = all_paragraph_hits(passages, lambda qs: [rag.retrieve(q, 1)[0].id for q in qs])
        else:
            from unimae.embedding.spec import EmbeddingSpec
            from unimae.evaluation.reference import load_minilm

            minilm = load_minilm()
            build_start = time.perf_counter()

            class MiniLMEncoder:  # the parts of Encoder that VectorIndex uses
                spec = EmbeddingSpec(attention="bidirectional", pooling="mean")  # what MiniLM does (recorded only)
                max_length = 256
                embedding_dim = minilm.get_embedding_dimension()
                precision, adapter_merged = "fp32", False  # recorded in the index manifest

                @staticmethod
                def encode(texts, batch_size=32, normalize=True, show_progress=False, **kwargs):
                    return minilm.encode(texts, batch_size=batch_size, normalize_embeddings=True)

                encode_document = encode_query = encode  # MiniLM has no prompts

            index = VectorIndex.build(MiniLMEncoder, passages, tmp, IndexConfig())
            build = time.perf_counter() - build_start
            every = all_paragraph_hits(
                passages, lambda qs: [h[0].id for h in index.search(np.asarray(MiniLMEncoder.encode(qs, 64)), 1)]
            )
        rows, prefill = [], []
        for q, target in zip(questions, chosen, strict=True):
            start = time.perf_counter()
            if mode == "one":
                answer = rag.answer(q, params=params)
                hits, seconds, new_tokens = answer.hits, time.perf_counter() - start, answer.completion_tokens
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
                reply = generate_text(llm.model, llm.tokenizer, ids, params, precision=llm.precision)
                seconds, new_tokens = time.perf_counter() - start, reply.completion_tokens
            rows.append({"seconds": seconds, "hit": hits[0].id == passages[target][0], "new_tokens": new_tokens})
    seconds = [r["seconds"] for r in rows]
    result = {
        "mode": mode,
        "models": f"{args.model} (embed + generate)" if mode == "one" else f"all-MiniLM-L6-v2 + {args.model}",
        "load_s": round(build_start - load_start, 1),
        "index_build_s": round(build, 1),
        "questions": len(rows),
        "p50_s": round(percentile(seconds, 50), 3),
        "p99_s": round(percentile(seconds, 99), 3),
        "retrieval_acc_at_1": round(sum(r["hit"] for r in rows) / len(rows), 3),
        **all_paragraphs_summary(every),
        "mean_new_tokens": round(statistics.mean(r["new_tokens"] for r in rows), 1),  # answers may stop early
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


def question_of(text: str) -> str:
    """A benchmark question: the first 12 words of its paragraph (the answer to find)."""
    return " ".join(text.split()[:12])


def all_paragraph_hits(passages: list[tuple[str, str]], top_ids) -> list[int]:
    """1/0 per held-out paragraph: does its question (its first words) find it at rank 1? Retrieval only, the
    way the setup retrieves for RAG: ``top_ids`` maps questions to their rank-1 passage ids (the one model's
    query path with its query prompt, or MiniLM's vectors searched in the same index kind)."""
    tops = top_ids([question_of(text) for _, text in passages])
    return [int(top == pid) for top, (pid, _) in zip(tops, passages, strict=True)]


def all_paragraphs_summary(hits: list[int]) -> dict:
    """acc@1 over every held-out paragraph's question, its binomial standard error, and the 1/0 per paragraph
    (the parent pairs the two setups' lists, then drops them)."""
    acc = sum(hits) / len(hits)
    return {
        "all_paragraphs": len(hits),
        "all_paragraphs_acc_at_1": round(acc, 4),
        "all_paragraphs_acc_at_1_se": round((acc * (1 - acc) / len(hits)) ** 0.5, 4),
        "all_paragraph_hits": hits,
    }


def paired(setups: list[dict]) -> dict:
    """The one and two setups' hits on the same paragraphs, paired: how many only one of them found (the
    discordant pairs a McNemar test counts); pops the per-paragraph lists from ``setups``."""
    hits = {setup["mode"]: setup.pop("all_paragraph_hits") for setup in setups}
    one, two = hits["one"], hits["two"]
    one_only = sum(a and not b for a, b in zip(one, two, strict=True))
    two_only = sum(b and not a for a, b in zip(one, two, strict=True))
    return {
        "paragraphs": len(one),
        "one_only": one_only,
        "two_only": two_only,
        "mcnemar_p": mcnemar_p(one_only, two_only),
    }


def mcnemar_p(b: int, c: int) -> float:
    """McNemar's exact test: the two-sided binomial p of ``b`` against ``c`` discordant pairs (1.0 for none)."""
    from math import comb

    n = b + c
    tail = sum(comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return round(min(1.0, 2 * tail), 6)


def record_rag(path: Path, model: str, adapter: str | None, setups: list[dict]) -> None:
    """Merge this run's RAG setups into ``path`` (``results/rag-benchmark.json``): one entry per setup and
    model, keyed ``<model>/<mode>``, with ``retrieval_acc1``, answer latency and peak RSS; other models'
    entries are kept."""
    from unimae.files import update_json

    entries = {}
    for setup in setups:
        entry = {"model": model, "adapter": adapter if setup["mode"] == "one" else None, **setup}
        entry["retrieval_acc1"] = entry.pop("retrieval_acc_at_1")
        entry["cpu_model"] = cpu_model()
        entries[f"{model}/{setup['mode']}"] = entry
    update_json(path, entries)


def _max_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--mix", choices=("normal", "hostile"), default="normal", help="hostile: see above.")
    parser.add_argument("--clients", type=int, default=None, help="Normal clients (default 8; 15 with --mix hostile).")
    parser.add_argument("--duration", type=float, default=60.0, help="Seconds of load.")
    parser.add_argument("--embed-share", type=float, default=0.7, help="Share of embedding requests.")
    parser.add_argument("--max-tokens", type=int, default=16, help="Tokens per completion / RAG answer.")
    parser.add_argument("--timeout", type=float, default=30.0, help="Client timeout of a normal request (s).")
    parser.add_argument("--big-inputs", type=int, default=256, help="Texts per large request (--mix hostile).")
    parser.add_argument("--big-tokens", type=int, default=512, help="Tokens per large text (--mix hostile).")
    parser.add_argument("--settle", type=float, default=2.0, help="Seconds idle before the after-run RSS.")
    hostile = parser.add_argument_group("--mix hostile: the hostile clients and the server limits they probe")
    hostile.add_argument("--idle-connections", type=int, default=32, help="Connections idle after one request.")
    hostile.add_argument("--silent-connections", type=int, default=8, help="Connections that never send a byte.")
    hostile.add_argument("--half-sent", type=int, default=4, help="Connections that stall after half a body.")
    hostile.add_argument("--hostile-pause", type=float, default=1.0, help="Seconds between long/malformed/leave.")
    hostile.add_argument("--body-timeout-s", type=float, default=10.0, help="The server's --body-timeout-s.")
    hostile.add_argument("--keep-alive-s", type=float, default=5.0, help="The server's --keep-alive-s.")
    hostile.add_argument("--header-timeout-s", type=float, default=10.0, help="The server's --header-timeout-s.")
    hostile.add_argument(
        "--max-body-bytes",
        type=int,
        default=ServerConfig.max_body_bytes,
        help="The server's --max-body-bytes; the long texts are just under and just over it.",
    )
    parser.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        help="Extra argument for unimae serve (repeat it: --server-arg=--embed-chunk-tokens --server-arg=1024).",
    )
    parser.add_argument("--questions", type=int, default=20, help="RAG questions per setup.")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-rag", action="store_true", help="Implied by --mix hostile.")
    parser.add_argument("--data-dir", default=os.environ.get("UNIMAE_DATA", str(ROOT.parent / "shared" / "data")))
    parser.add_argument(
        "--output",
        default=None,
        help="JSON path (default: benchmarks/results/load_test.json; results/load-test.json with --mix hostile).",
    )
    parser.add_argument(
        "--rag-output",
        default=str(RAG_OUTPUT),
        help="The RAG setups are also merged into this JSON, one entry per setup and model ('' to skip).",
    )
    parser.add_argument("--rag-worker", choices=("one", "two"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rag_worker:
        print(json.dumps(rag_worker(args.rag_worker, args)))
        return
    hostile = args.mix == "hostile"
    args.clients = args.clients if args.clients is not None else (15 if hostile else 8)
    output = Path(args.output or (HOSTILE_OUTPUT if hostile else RESULTS / "load_test.json"))
    payload = {
        "model": args.model,
        "adapter": args.adapter,
        "revision": adapter_revision(resolve_adapter(args.adapter)),
    }
    if not args.skip_server:
        payload["server"] = server_load_test(args)
        print(json.dumps(payload["server"], indent=2))
    if not args.skip_rag and not hostile:
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
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:  # show why: the worker's own traceback
                sys.exit(f"the RAG worker '{mode}' failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            out = done.stdout
            payload["rag"].append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps({k: v for k, v in payload["rag"][-1].items() if k != "all_paragraph_hits"}, indent=2))
        payload["rag_paired"] = paired(payload["rag"])
        print(json.dumps(payload["rag_paired"]))
        if args.rag_output:
            record_rag(Path(args.rag_output), args.model, args.adapter, payload["rag"])
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
