"""unimae's model for ``lm-eval``: HFLM that runs a shared context once and the output head only where scored.

lm-eval's ``HFLM`` scores each (context, continuation) request as its own row and computes the output head
and a log-softmax at every position of every padded row, then keeps the continuation's positions. In a
multiple-choice task the choices share their context (HellaSwag: 4 endings after one ~80-token context), and
on a small model the head is a large share of the work (Gemma-3-270M's 262k x 640 head has more weights than
its 18 layers together). :class:`ScoredLM` keeps everything else of HFLM (tokenization, truncation, rolling
windows, generation, lm-eval's request cache and its metrics) and overrides ``_loglikelihood_tokens`` alone:

- requests with the same (truncated) context are packed into one row, ``context + continuation_1[:-1] +
  continuation_2[:-1] + ...``, each continuation attending to the context and to itself only
  (:func:`unimae.embedding.attention.branches_allowed`, a 4D mask) and numbered from the context's end (position ids),
  so each is scored exactly as in its own row;
- the head and an fp32 log-softmax run on the scored positions only, in row chunks (a rolling window of 2k
  tokens scores every position).

Decision: a packed row is at most ``min(max_length, sliding_window)`` tokens, since a 4D mask takes the place
of a sliding layer's window (Gemma-3: 512); longer groups are split into several rows.
The numbers are HFLM's up to rounding: HFLM takes its log-softmax in the model's dtype (bf16 here) where this
takes it in fp32, and packing changes the order of the sums, so a near-tie between two choices can fall the
other way. Compare results of one scorer only (``evaluate generation --scorer``; it is part of each task
record's identity).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

from unimae.embedding.attention import branches_allowed, sliding_window, to_model_mask
from unimae.losses.cross_entropy import head_logits, logit_softcap, output_projection

Request = tuple[tuple[str, str] | None, list[int], list[int]]  # (cache key, context tokens, continuation tokens)


@dataclass
class Row:
    """One row of a batch: a context and the continuations packed after it (indices into the requests)."""

    context: list[int]
    continuations: list[list[int]] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.context) + sum(len(c) - 1 for c in self.continuations)

    def tokens(self) -> tuple[list[int], list[int], list[int]]:
        """(input ids, position ids, segment ids: 0 context, j continuation j) of the packed row."""
        ids, positions, segments = list(self.context), list(range(len(self.context))), [0] * len(self.context)
        for j, continuation in enumerate(self.continuations, 1):
            ids += continuation[:-1]
            positions += range(len(self.context), len(self.context) + len(continuation) - 1)
            segments += [j] * (len(continuation) - 1)
        return ids, positions, segments

    def scored(self) -> list[list[int]]:
        """Per continuation, the positions whose next-token logits score it: the context's last, then its own."""
        spans, start = [], len(self.context)
        for continuation in self.continuations:
            spans.append([len(self.context) - 1, *range(start, start + len(continuation) - 1)])
            start += len(continuation) - 1
        return spans


def pack_rows(requests: list[Request], max_length: int, pack_limit: int) -> list[Row]:
    """Rows of requests sharing a context, each at most ``pack_limit`` tokens (a request alone may take up to
    ``max_length``). A context is what HFLM keeps of it: ``(context + continuation)[-(max_length + 1):]``
    less the continuation."""
    open_rows: dict[tuple[int, ...], Row] = {}
    rows = []
    for index, (_, context, continuation) in enumerate(requests):
        if not context or not continuation or len(continuation) > max_length:
            raise ValueError(f"a request needs a context and a continuation of 1..{max_length} tokens")
        kept = (context + continuation)[-(max_length + 1) :]
        key = tuple(kept[: len(kept) - len(continuation)])
        row = open_rows.get(key)
        if row is None or len(row) + len(continuation) - 1 > pack_limit:
            row = open_rows[key] = Row(list(key))
            rows.append(row)
        row.continuations.append(continuation)
        row.requests.append(index)
    return rows


class ScoredLM(HFLM):
    """``HFLM`` whose loglikelihood requests share their context's forward pass and compute logits at the
    continuation's positions only (see the module doc).

    ``chunk_size``: scored positions per head matmul (the fp32 log-probabilities of one chunk are
    chunk_size x vocabulary x 4 bytes: 1 GiB for 1,024 rows of Gemma's 262k vocabulary).
    """

    def __init__(self, *args, chunk_size: int = 1024, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_size = chunk_size

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy continuation) per request,
        in request order. Rows run longest first in batches of ``batch_size``; packed rows and single
        requests in separate batches (only the packed need a 4D mask)."""
        batch_size = override_bs or (self.batch_size if isinstance(self.batch_size, int) else 16)
        window = sliding_window(self.model) or self.max_length  # a packed row stays within a sliding window
        rows = pack_rows(requests, self.max_length, min(self.max_length, window))
        singles = sorted((row for row in rows if len(row.requests) == 1), key=len, reverse=True)
        packed = sorted((row for row in rows if len(row.requests) > 1), key=len, reverse=True)
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Scoring continuations")
        for group in (singles, packed):
            for start in range(0, len(group), batch_size):
                for index, answer in self._score(group[start : start + batch_size]):
                    answers[index] = answer
                    if requests[index][0] is not None:  # rolling windows have no key: lm-eval caches their sum
                        self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
                    bar.update(1)
        bar.close()
        return answers

    def _score(self, batch: list[Row]) -> list[tuple[int, tuple[float, bool]]]:
        """(request index, answer) for the requests of one batch of rows: the decoder over the right-padded
        rows, then the head on the scored positions."""
        packed = [row.tokens() for row in batch]
        width = max(len(ids) for ids, _, _ in packed)
        input_ids = torch.full((len(batch), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)  # (B, T)
        position_ids = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
        segments = torch.full((len(batch), width), -1, dtype=torch.long)  # (B, T) -1 = padding
        for b, (ids, positions, segment) in enumerate(packed):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            position_ids[b, : len(ids)] = torch.tensor(positions)
            segments[b, : len(ids)] = torch.tensor(segment)
        hidden = self._hidden(input_ids, position_ids, segments)  # (B, T, D)
        spans = [(b, span) for b, row in enumerate(batch) for span in row.scored()]
        batch_index = torch.cat([torch.full((len(span),), b) for b, span in spans])  # (N,)
        positions = torch.tensor([p for _, span in spans for p in span])  # (N,)
        targets = torch.tensor([t for row in batch for c in row.continuations for t in c], device=self.device)  # (N,)
        log_probs, greedy = self._token_scores(hidden[batch_index, positions], targets)  # (N,), (N,)
        sizes = [len(span) for _, span in spans]
        requests = [index for row in batch for index in row.requests]
        return [
            (index, (float(lp.sum()), bool(g.all())))
            for index, lp, g in zip(requests, log_probs.split(sizes), greedy.split(sizes), strict=True)
        ]

    def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """Last-layer states of the (adapter-wrapped) LLM, without its head. (B, T) each -> (B, T, D).
        Rows of single requests need no mask (right padding is invisible to a causal model)."""
        mask = None
        if segments.max() > 1:  # a packed row: its continuations must not see each other
            mask = to_model_mask(branches_allowed(segments.to(self.device)), self.model)  # within the window
        with torch.no_grad():
            return self.model.get_decoder()(
                input_ids=input_ids.to(self.device),
                attention_mask=mask,
                position_ids=position_ids.to(self.device),
                use_cache=False,
            ).last_hidden_state

    def _token_scores(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(target), target is the argmax) per row, fp32 log-softmax in chunks. (N, D), (N,) -> (N,), (N,)."""
        weight, bias = output_projection(self.model.get_output_embeddings())  # (V, D), (V,) or None
        softcap = logit_softcap(self.model.config)
        log_probs, greedy = [], []
        with torch.no_grad():
            for start in range(0, hidden.shape[0], self.chunk_size):
                rows = slice(start, start + self.chunk_size)
                logits = head_logits(hidden[rows], weight, bias, softcap).float()  # (n, V)
                target = logits.gather(1, targets[rows, None]).squeeze(1)  # (n,)
                log_probs.append(target - logits.logsumexp(-1))  # log-softmax at the target only
                greedy.append(logits.argmax(-1) == targets[rows])
        return torch.cat(log_probs), torch.cat(greedy)
