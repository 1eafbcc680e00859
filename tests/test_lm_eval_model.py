"""ScoredLM (head on the scored positions only) against lm-eval's own HFLM, on tiny random models."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SENTENCES, build_model, build_tokenizer
from unimae.evaluation.lm_eval_model import pack_rows


def test_rows_pack_one_context_up_to_the_limit():
    requests = [(None, [1, 2, 3], [4, 5]), (None, [1, 2, 3], [6]), (None, [9], [4]), (None, [1, 2, 3], [7, 8, 9])]
    rows = pack_rows(requests, max_length=8, pack_limit=5)
    assert [row.requests for row in rows] == [[0, 1], [2], [3]]  # 3 + 1 + 0 = 4 tokens; + 2 would be 6 > 5
    ids, positions, segments = rows[0].tokens()
    assert (ids, positions, segments) == ([1, 2, 3, 4], [0, 1, 2, 3], [0, 0, 0, 1])
    assert rows[0].scored() == [[2, 3], [2]]
    with pytest.raises(ValueError, match="continuation"):
        pack_rows([(None, [1], [])], max_length=8, pack_limit=8)


def test_branches_see_the_context_and_themselves():
    from unimae.embedding.attention import branches_allowed

    allowed = branches_allowed(torch.tensor([[0, 0, 1, 1, 2, -1]]))[0]
    assert allowed[3].tolist() == [True, True, True, True, False, False]
    assert allowed[4].tolist() == [True, True, False, False, True, False]
    assert not allowed[5].any()  # padding (to_model_mask lets it see itself)


def _models(arch: str, window: int = 64):
    from lm_eval.models.huggingface import HFLM

    from unimae.evaluation.lm_eval_model import ScoredLM

    tokenizer = build_tokenizer(add_bos=arch != "qwen2", with_mask=arch != "qwen2")
    model = build_model(arch, len(tokenizer))
    if arch == "gemma3":
        model.config.final_logit_softcapping = 3.0  # small enough to change every logit
        model.config.sliding_window = window  # 64: never binds in rows of up to 24 tokens; 6: binds in most
    kwargs = dict(pretrained=model, tokenizer=tokenizer, max_length=24)
    return HFLM(batch_size=3, **kwargs), ScoredLM(batch_size=2, chunk_size=5, **kwargs), tokenizer


def _requests(tokenizer) -> list:
    """Choices after a shared context (a one-token one among them), as multiple-choice tasks ask."""
    requests = []
    for i, sentence in enumerate(SENTENCES):
        words = sentence.split()
        context = " ".join(words[: 2 + i % 5])
        endings = [" " + " ".join(words[2 + i % 5 :]), " " + SENTENCES[i - 1].split()[-1], " and the dog"]
        for ending in endings:
            ids = tokenizer.encode(ending, add_special_tokens=False)
            requests.append(((context, ending), tokenizer.encode(context), ids))
        requests.append(((context, "first token"), tokenizer.encode(context), requests[-3][2][:1]))
    requests.append((None, requests[-1][1] * 10, requests[-1][2]))  # context truncated to max_length, no cache key
    return requests


@pytest.mark.parametrize(("arch", "window"), [("llama", 0), ("gemma3", 64), ("gemma3", 6), ("qwen2", 0)])
def test_scores_equal_hflm(arch, window):
    """Packed rows score as lm-eval's HFLM scores each request alone, also where Gemma's sliding window binds
    (6 tokens: rows are packed only up to the window, longer requests are scored alone under the model's
    own windowed mask)."""
    reference, scored, tokenizer = _models(arch, window)
    requests = _requests(tokenizer)
    assert any(len(c) + len(x) > 25 for _, c, x in requests)  # one request is truncated
    assert any(len(x) == 1 for _, _, x in requests)
    assert len(pack_rows(requests, 24, 64)) < len(requests) / 2  # choices share their row
    with torch.no_grad():
        expected = reference._loglikelihood_tokens(requests, disable_tqdm=True)
        got = scored._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in expected]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], rel=1e-5, abs=1e-4)


def test_answers_reach_lm_evals_request_cache():
    _, scored, tokenizer = _models("llama")
    requests = _requests(tokenizer)
    seen = []

    class Hook:
        def add_partial(self, kind, key, answer):
            seen.append((kind, key, answer))

    scored.set_cache_hook(Hook())
    answers = scored._loglikelihood_tokens(requests, disable_tqdm=True)
    assert len(seen) == len(requests) - 1  # the keyless request is not cached
    assert {key: answer for _, key, answer in seen} == {r[0]: a for r, a in zip(requests, answers, strict=True) if r[0]}


def test_an_empty_continuation_is_refused():
    _, scored, tokenizer = _models("llama")
    with pytest.raises(ValueError, match="continuation"):
        scored._loglikelihood_tokens([(None, tokenizer.encode("the cat"), [])], disable_tqdm=True)


@pytest.mark.parametrize("name", ["hf", "unimae"])
def test_a_model_whose_adapter_trains_token_rows_can_be_scored(name):
    """GEM adapters train their summary rows (peft trainable_token_indices), which wraps the tied embedding;
    lm-eval's start-up tie_weights() must not fail on it."""
    import math

    from peft import LoraConfig, get_peft_model

    from unimae.evaluation.generation import build_scorer

    tokenizer = build_tokenizer(add_bos=True, with_mask=True)
    model = build_model("llama", len(tokenizer))
    assert model.config.tie_word_embeddings
    rows = {"embed_tokens": [len(tokenizer) - 1]}
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", trainable_token_indices=rows))
    lm = build_scorer(name, adapted, tokenizer, batch_size=2, max_length=24)
    with torch.no_grad():
        answers = lm._loglikelihood_tokens(_requests(tokenizer)[:4], disable_tqdm=True)
    assert all(math.isfinite(lp) and lp < 0 for lp, _ in answers)
    assert "tie_weights" not in vars(model)  # the start-up guard is gone again
