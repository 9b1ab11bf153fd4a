"""Stop strings and min_tokens. A stop string is found in incrementally detokenized text and
cut off it (vLLM's rule: the token ids keep the token that completed it); before min_tokens no
stop counts — stop strings are not searched and EOS / stop token ids are never drawn (oracle:
transformers' generate with min_new_tokens)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import checkpoint, mixed_prompts
from tiny_tokenizer import add_tokenizer, load_tokenizer

from splash import LLM, SamplingParams

MAX = 24


@pytest.fixture(scope="module")
def setup():
    path = add_tokenizer(checkpoint("v3"))
    prompts = mixed_prompts(seed=1, lengths=(4, 9, 5))
    with LLM(path, tp_size=1, backend="cpu", layout="tp", page_size=4) as llm:
        base = llm.generate(prompts, SamplingParams(max_tokens=MAX, temperature=0.0,
                                                    ignore_eos=True))
        yield llm, prompts, [o.token_ids for o in base], load_tokenizer()


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _first_completion(tok, ids, stop, from_token=0):
    """The first k >= from_token whose token completes ``stop`` in the decoded text."""
    for k in range(max(from_token, 1), len(ids) + 1):
        before, text = _decode(tok, ids[:k - 1]), _decode(tok, ids[:k])
        if stop in text[max(len(before) - len(stop) + 1, 0):]:
            return k
    return None


def _stop_string(text, start):
    """A 2-character stop string from ``text`` at or after ``start`` (no U+FFFD)."""
    for i in range(start, len(text) - 1):
        s = text[i:i + 2]
        if "\ufffd" not in s and text.find(s) == i:
            return s
    return None


def test_stop_string_is_cut_off(setup):
    llm, prompts, base, tok = setup
    stops = [_stop_string(_decode(tok, ids), 3) for ids in base]
    assert None not in stops
    # the three requests in one batch, as ``base`` was drawn (each stops on its own step)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True,
                                                 stop=[stop, "\x7f\x7f\x7f"]) for stop in stops])
    for out, ids, stop in zip(outs, base, stops, strict=True):
        k = _first_completion(tok, ids, stop)
        assert out.token_ids == ids[:k]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        full = _decode(tok, ids[:k])
        assert out.text == full[:full.index(stop)]
    assert llm.stats()["kv_pages_used"] == [0]


def test_min_tokens_ignores_an_earlier_stop_string(setup):
    llm, prompts, base, tok = setup
    m = 10
    stops = [_stop_string(_decode(tok, ids[:m - 1]), 0) for ids in base]
    assert None not in stops
    # the three requests in one batch, as ``base`` was drawn (one run of at most MAX steps)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True,
                                                 stop=stop, min_tokens=m) for stop in stops])
    for out, ids, stop in zip(outs, base, stops, strict=True):
        k = _first_completion(tok, ids, stop, from_token=m)
        assert out.token_ids == ids[:k or MAX]
        assert out.finish_reason == ("stop" if k else "length")


def test_min_tokens_holds_eos_and_stop_token_ids_back(setup):
    import transformers

    llm, prompts, base, _ = setup
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint("v3"),
                                                              dtype=torch.float32)
    for m in (0, 6):  # the three requests in one batch, as ``base`` was drawn
        outs = llm.generate(prompts, [SamplingParams(
            max_tokens=12, temperature=0.0, stop_token_ids=[ids[1], ids[4]], min_tokens=m)
            for ids in base])
        for prompt, ids, out in zip(prompts, base, outs, strict=True):
            stops = [ids[1], ids[4]]  # greedy would stop at once without min_tokens
            x = torch.tensor([prompt])
            with torch.no_grad():
                gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=12, min_new_tokens=m,
                                     eos_token_id=[1, *stops], pad_token_id=0)
            assert out.token_ids == gen[0, len(prompt):].tolist()
            assert not {1, *stops} & set(out.token_ids[:m])
            if m == 0:  # greedy draws ids[1] second
                assert out.token_ids == ids[:2] and out.stop_reason == ids[1]
            if out.finish_reason == "stop":
                assert out.token_ids[-1] in {1, *stops}
