"""On-device token sampling, one set of parameters per row.

temperature 0 is greedy (argmax, first index on ties). Otherwise logits / temperature are
restricted to the top_k (0 = all) highest and to the smallest set whose probability reaches
top_p (the top token always kept), then one token is drawn. A row with a seed draws from a
generator seeded by (seed, step), so the same request reproduces its tokens whatever batch it
shares; rows without a seed use `generator` (or the default one). Values are validated where
SamplingParams are built, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """Deterministic 63-bit generator seed for (request seed, decode step) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFF_FFFF_FFFF_FFFF


def _filter(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. logits (n, V) fp32."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (n, V)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # probability mass ranked above each token
    drop |= (before >= top_p[:, None]) & (ranks > 0)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: torch.Tensor, seeds: Sequence[int | None] | None = None,
           steps: Sequence[int] | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (n, V); temperature, top_p (n,) float; top_k (n,) int; seeds / steps: per row
    (step = index of the token being drawn) -> token ids (n,) int64 on logits.device."""
    logits = logits.float()
    dev = logits.device
    temperature, top_p = temperature.to(dev, torch.float32), top_p.to(dev, torch.float32)
    top_k = top_k.to(dev, torch.int64)
    out = logits.argmax(dim=-1)
    rand_rows = (temperature > 0).nonzero(as_tuple=True)[0]
    if rand_rows.numel() == 0:
        return out
    sub = logits[rand_rows] / temperature[rand_rows, None]  # (m, V)
    if bool((top_k[rand_rows] > 0).any() | (top_p[rand_rows] < 1).any()):
        sub = _filter(sub, top_p[rand_rows], top_k[rand_rows])
    probs = sub.softmax(-1)
    # Exponential race: argmax(p / E), E ~ Exp(1), draws from p (one noise row per request).
    noise = torch.empty_like(probs)
    seeded = [] if seeds is None else [i for i, r in enumerate(rand_rows.tolist())
                                       if seeds[r] is not None]
    if len(seeded) < rand_rows.numel():
        noise.exponential_(generator=generator)
    for i in seeded:
        r = int(rand_rows[i])
        seed = seeds[r] if seeds is not None else None
        assert seed is not None
        g = torch.Generator(device=dev)
        g.manual_seed(mix_seed(int(seed), 0 if steps is None else int(steps[r])))
        noise[i].exponential_(generator=g)
    # A zero draw would make filtered tokens 0/0 = nan; keep noise strictly positive.
    out[rand_rows] = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of logits (n, V) in fp32 at ``tokens`` (n,) and its top-k per row ->
    (logprob (n,), top ids (n, k), top logprobs (n, k))."""
    logp = logits.float().log_softmax(dim=-1)  # (n, V)
    chosen = logp.gather(1, tokens.long()[:, None])[:, 0]
    top_lp, top_ids = logp.topk(k, dim=-1, sorted=True)
    return chosen, top_ids, top_lp
