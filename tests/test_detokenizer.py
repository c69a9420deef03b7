"""Incremental detokenization: released text concatenates to the full decode, stop strings cut it (also across
token boundaries) and nothing after them leaks, partial UTF-8 characters are held back."""

import pytest
import torch
from transformers import AutoTokenizer

from runtime.engine.request import Request, SamplingParams
from runtime.engine.sampler import token_logprobs
from runtime.online.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def stream(tok, text: str, stops: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, stops)
    pieces = [d.add([t]) for t in tok(text)["input_ids"] if not d.stopped]
    return pieces + [d.flush()], d


def test_without_stops_the_pieces_are_the_decode(tok):
    text = "Once upon a time there was a little village by the sea"
    pieces, d = stream(tok, text, [])
    assert "".join(pieces) == tok.decode(tok(text)["input_ids"]) and not d.stopped


def test_a_stop_string_across_tokens_cuts_the_text(tok):
    pieces, d = stream(tok, "The capital of France is Paris, a city", ["France is"])
    assert "".join(pieces) == "The capital of " and d.stopped
    assert all("France" not in p for p in pieces)


def test_partial_characters_are_held_back(tok):
    ids = tok("café ☕ ok")["input_ids"]
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.flush() == tok.decode(ids)


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(3, 50)
    reqs = [Request([1], SamplingParams(logprobs=2)), Request([1]), Request([1], SamplingParams(logprobs=0))]
    tokens = [7, 8, 9]
    out = token_logprobs(logits, reqs, tokens)
    ref = torch.log_softmax(logits, dim=-1)
    assert out[1] is None and out[2].top == [] and out[2].logprob == pytest.approx(ref[2, 9].item())
    top = ref[0].topk(2)
    assert out[0].logprob == pytest.approx(ref[0, 7].item())
    assert [t for t, _ in out[0].top] == top.indices.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(top.values.tolist())
