"""Controller ↔ worker messages: the one typed step plan out, one result back (msgspec/msgpack).

Control travels only here (ZeroMQ); tensors travel only over torch.distributed. Each worker
gets its own plan: the batch is the same for all ranks, the block-table updates are its own.
"""

from __future__ import annotations

import msgspec

WORKER_PROTOCOL_VERSION = 5


class SeqSampling(msgspec.Struct, frozen=True):
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int
    seed: int | None  # with the output index, seeds this row's sampling
    logprobs: int | None = None  # with each draw: the chosen token's logprob and the top-k
    banned: list[int] = []  # token ids that may not be drawn (min_tokens holds EOS/stops back)
    draws: int = 1  # tokens drawn from the row: n at an n-sample prompt's last row, draw i
    #                 seeded by sample_seed(seed, i)


class PromptLogprobs(msgspec.Struct, frozen=True):
    """Rows of one request that score prompt tokens (the logprob of the next prompt token)."""

    index: int  # the request's index in the step
    first_row: int  # the first of its rows that scores one
    targets: list[int]  # the prompt tokens rows first_row, first_row + 1, ... score
    k: int  # top-k to return beside each target


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-softmax of one row's fp32 logits at the chosen (or scored) token, then the top-k."""

    token_ids: list[int]  # chosen token first, then the top-k by rank
    logprobs: list[float]


class TableUpdate(msgspec.Struct, frozen=True):
    request_id: str
    start: int  # this rank's local block table becomes table[:start] + pages
    pages: list[int]


class WeightMove(msgspec.Struct, frozen=True):
    """Placed projection heads [head_start, head_stop) that this rank must end up holding."""

    head_start: int
    head_stop: int
    recv_from: list[list[int]]  # per source rank: head ids it sends this rank (ascending)
    send_to: list[list[int]]  # per destination rank: head ids this rank sends (ascending)


class KVMove(msgspec.Struct, frozen=True):
    """KV rows moved by one all-to-all per layer group. Rows are given as runs of consecutive
    slots of this rank's page pool, flat ``[first_slot, rows, first_slot, rows, ...]`` (a page
    is one run: the message stays small whatever the context); the order of rows sent to rank
    d equals the order rank d expects from this rank."""

    send_runs: list[list[int]]  # per destination rank
    recv_runs: list[list[int]]  # per source rank


def run_rows(runs: list[int]) -> int:
    """Rows covered by a flat run list."""
    return sum(runs[1::2])


SWITCH_MODES = ("live", "blocking", "precopy", "handoff", "cancel")


class SwitchPlan(msgspec.Struct, frozen=True):
    """A rank's part of a switch. ``live``: the step computes in ``dst`` and each layer's state
    moves while the layer before it computes; ``blocking``: everything moves first (baseline).
    Background switches take three steps' plans: ``precopy`` starts moving the state on the
    transfer group while the step still computes in ``src``; ``handoff`` (a later step)
    completes it, moves the rows written since (the delta) and computes in ``dst``; ``cancel``
    drops a pre-copy the engine abandoned."""

    src: str  # layout before the switch
    dst: str  # layout after it
    weights: WeightMove
    kv: KVMove
    mode: str = "live"
    # the same on every rank, so that all ranks enter the same collectives: whether any rank
    # moves KV rows / projection heads, and how many layers share one collective
    kv_moves: bool = True
    heads_move: bool = True
    layers_per_group: int = 1

    @property
    def hooks_forward(self) -> bool:
        """The transfer interleaves with the step's layers (``live``): that step runs eagerly.
        Every other mode completes its part before or beside the forward, which may then
        replay a CUDA graph."""
        return self.mode == "live"


class WeightLoad(msgspec.Struct, frozen=True):
    """New values for model tensors, copied in place (no request runs meanwhile)."""

    path: str  # checkpoint directory (safetensors) holding them
    names: list[str]  # HF tensor names to load from it


class StepPlan(msgspec.Struct, frozen=True):
    version: int
    step: int
    layout: str  # layout the step computes in
    request_ids: list[str]  # scheduled requests in row order
    query_lens: list[int]  # rows per request
    context_lens: list[int]  # KV length per request after this step
    owners: list[int]  # owner rank per request (used by owned layouts)
    input_ids: list[int]  # N rows
    positions: list[int]  # N rows
    sample: list[bool]  # per request: sample a token after this step
    sampling: list[SeqSampling]  # per request (only read where sample is True)
    output_index: list[int]  # per request: index of the token being sampled (for seeds)
    table_updates: list[TableUpdate] = []  # this rank's block-table changes
    released: list[str] = []  # requests whose tables this rank drops
    prompt_logprobs: list[PromptLogprobs] = []  # rank 0 scores these prompt rows
    page_copies: list[list[int]] = []  # [src, dst] pages on this rank, copied (all layers)
    #                                    before the step computes: copy-on-write of shared pages
    switch: SwitchPlan | None = None
    load_weights: WeightLoad | None = None  # a weight update instead of a step
    shutdown: bool = False
    # asynchronous scheduling: input ids < 0 are draw -1 - id of step ``inputs_from_step``
    # (the step before, whose tokens the controller did not know yet); ``share_samples``:
    # every rank keeps this step's draws on the device for the next step's inputs
    inputs_from_step: int = -1
    share_samples: bool = False
    # the workers' profiler (`LLMEngine.profile_steps`): "start" before this step, "stop"
    # before this step (the summary goes to ``profile_dir``)
    profile: str = ""
    profile_dir: str = ""


class StepResult(msgspec.Struct, tag=True):
    version: int
    step: int
    rank: int
    tokens: list[int] = []  # rank 0: `draws` per request with sample=True, in order
    logprobs: list[TokenLogprobs] = []  # rank 0: one per draw whose row asked for logprobs
    prompt_logprobs: list[list[TokenLogprobs]] = []  # rank 0: per plan.prompt_logprobs entry
    elapsed_ms: float = 0.0  # forward time of this rank
    switch_ms: float = 0.0  # host time of the switch's work in this step (issue, wait, install)
    # device time of that work on the step's stream (pack, collectives, unpack) where events
    # time it (GPUs, switches completed within one step); None elsewhere
    switch_device_ms: float | None = None
    graph_replay: bool = False  # the step was replayed from a CUDA graph
    kv_bytes_received: int = 0
    weight_bytes_received: int = 0
    precopy_done: bool = True  # no background transfer of this rank is still in flight
    error: str | None = None  # a worker-side failure, reported instead of tokens
    # with an error: the worker kept its state and serves on (an out-of-memory error of a
    # single-rank group outside a switch); only this step's requests fail
    recoverable: bool = False


class WorkerProfile(msgspec.Struct, tag=True):
    """A worker's first start-up report, before its KV pool exists: what its weights take and
    the peak activation memory of its profiling steps (0: not measured, e.g. on the CPU)."""

    rank: int
    pid: int
    device: str
    weight_bytes: int = 0  # device memory held after loading the weights
    activation_bytes: int = 0  # peak above that during the profiling steps
    decode_bytes: int = 0  # peak of the largest decode step alone (sizes the graph reserve)
    error: str | None = None  # start-up failed (the controller refuses to start)
    oom: bool = False  # the error is the profiling step running out of memory


class KVPoolSize(msgspec.Struct, tag=True):
    """The controller's answer to the profiles: the KV pages every rank allocates."""

    num_pages: int


class WorkerReady(msgspec.Struct, tag=True):
    rank: int
    pid: int
    num_pages: int  # physical pages in this rank's KV pool
    device: str
    error: str | None = None
    graphs: int = 0  # CUDA graphs captured at start-up
    graph_s: float = 0.0  # their capture time
    graph_bytes: int = 0  # device memory they took (graph pool and buffers)


class WorkerHello(msgspec.Struct, tag=True):
    """First message of a worker started outside the controller (torchrun): its rank."""

    rank: int
    world: int


_plan_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_pool_decoder = msgspec.msgpack.Decoder(KVPoolSize)
_result_decoder = msgspec.msgpack.Decoder(
    StepResult | WorkerReady | WorkerProfile | WorkerHello)  # type: ignore[arg-type]


def encode(msg: msgspec.Struct) -> bytes:
    return _plan_encoder.encode(msg)


def decode_plan(buf: bytes) -> StepPlan:
    plan = _plan_decoder.decode(buf)
    if plan.version != WORKER_PROTOCOL_VERSION:
        raise ValueError(f"worker protocol version {plan.version} != {WORKER_PROTOCOL_VERSION}")
    return plan


def decode_pool_size(buf: bytes) -> KVPoolSize:
    return _pool_decoder.decode(buf)


def decode_result(buf: bytes) -> StepResult | WorkerReady | WorkerProfile | WorkerHello:
    return _result_decoder.decode(buf)
