"""The LM head's loss over vocabulary slices (memory.chunked.vocab) and its weight streamed a
slice at a time (memory.offload.slices): loss and gradients equal to the unchunked loss within
1e-6 relative (ignored tokens, a masked span, an uneven last slice, a bias); the streamed source
bitwise equal to the resident one; a tiny Llama (vocabulary 32000) with every unit's weights
streamed and the head in vocabulary slices training bitwise as the same loss on resident weights
with the device's AdamW (prompt tokens labelled -100), also clipping and accumulating; LoRA on a
frozen base whose head's slices stream with no gradient; a tied head refused; the plan field; and
the stream-weights floor against the host optimizer's, with the measured peak against the
prediction."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from superneurons.errors import ConfigError
from superneurons.memory import HeadChunking, Plan, UnitDecision, apply_plan
from superneurons.memory.chunked.lmhead import chunk_head
from superneurons.memory.chunked.vocab import (
    MIN_VOCAB_ROWS,
    slice_bounds,
    vocab_cross_entropy,
    vocab_rows_for,
)
from superneurons.memory.offload.slices import StreamedRows

N, H, V = 203, 48, 1000  # 1000 rows in slices of 300: three full slices and one of 100


def _inputs(*, bias: bool = False) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=gen)
    weight = 0.05 * torch.randn(V, H, generator=gen)
    b = 0.1 * torch.randn(V, generator=gen) if bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -100  # scattered ignored tokens
    targets[64:128] = -100  # a masked span (a prompt, padding)
    return hidden, weight, b, targets


def _grads(loss_of: Any, *tensors: torch.Tensor | None) -> tuple[torch.Tensor, list[Any]]:
    leaves = [t.clone().requires_grad_() for t in tensors if t is not None]
    loss = loss_of(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("rows", [128, 300, V], ids=["8-slices", "uneven", "one-slice"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_loss_and_gradients_equal_the_unchunked_loss(rows: int, bias: bool) -> None:
    """Within 1e-6 relative, not bitwise: the log-sum-exp is summed slice by slice (online),
    and dh sums one partial GEMM per slice (module docstring)."""
    hidden, weight, b, targets = _inputs(bias=bias)

    def reference(h, w, bb=None):  # type: ignore[no-untyped-def]
        return F.cross_entropy(F.linear(h, w, bb).float(), targets)

    def sliced(h, w, bb=None):  # type: ignore[no-untyped-def]
        return vocab_cross_entropy(h, w, targets, vocab_rows=rows, bias=bb)

    ref_loss, ref_grads = _grads(reference, hidden, weight, b)
    loss, grads = _grads(sliced, hidden, weight, b)
    assert _relative(loss, ref_loss) <= 1e-6
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert _relative(grad, ref) <= 1e-6
    assert grads[0][64:128].abs().max() == 0  # a masked span gets no gradient
    # the sum over a given count of tokens (Hugging Face's num_items_in_batch)
    total = vocab_cross_entropy(hidden, weight, targets, vocab_rows=rows, bias=b, num_items=1)
    expected = F.cross_entropy(F.linear(hidden, weight, b), targets, reduction="sum")
    assert _relative(total, expected) <= 1e-6


def test_the_streamed_source_is_bitwise_the_resident_one() -> None:
    """Slices copied from a host copy and gradients written to a host buffer: the same bits
    (on the CPU the copies are exact and every op is the same)."""
    hidden, weight, _, targets = _inputs()
    loss, grads = _grads(
        lambda h, w: vocab_cross_entropy(h, w, targets, vocab_rows=300), hidden, weight
    )
    source = StreamedRows(weight.clone(), torch.device("cpu"))
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    streamed = vocab_cross_entropy(*leaves, targets, vocab_rows=300, source=source)
    streamed.backward()
    assert torch.equal(streamed, loss)
    assert torch.equal(leaves[0].grad, grads[0]) and torch.equal(leaves[1].grad, grads[1])
    assert source.last_gradient is not None
    # the host buffer itself, not a copy of it
    assert leaves[1].grad.data_ptr() == source.last_gradient.buffer_ptr
    assert source.counters["fetches"] == 2 * 4  # four slices, forward and backward
    # under a plan the host optimizer takes the buffer instead of autograd
    delivered: list[torch.Tensor] = []
    source.deliver = delivered.append
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    vocab_cross_entropy(*leaves, targets, vocab_rows=300, source=source).backward()
    assert leaves[1].grad is None and torch.equal(delivered[0], grads[1])
    assert delivered[0].data_ptr() == source.last_gradient.buffer_ptr


def test_slices_come_from_bytes() -> None:
    assert slice_bounds(1000, 300) == ((0, 300), (300, 600), (600, 900), (900, 1000))
    # a toy head: the minimum; at most the vocabulary
    assert vocab_rows_for(64, 64, 32000, 4) == MIN_VOCAB_ROWS
    assert vocab_rows_for(64, 64, 500, 4) == 500
    # Llama-3-8B at 8192 tokens, bf16: working set (3 r H x 2 B + 4 N r) <= N H x 2 B
    rows = vocab_rows_for(8192, 4096, 128256, 2)
    assert rows & (rows - 1) == 0 and rows * (3 * 4096 * 2 + 4 * 8192) <= 8192 * 4096 * 2
    assert (2 * rows) * (3 * 4096 * 2 + 4 * 8192) > 8192 * 4096 * 2
    with pytest.raises(ConfigError, match="positive"):
        vocab_rows_for(0, 64, 100, 4)


def test_plan_field_round_trips_and_is_left_out_when_unset() -> None:
    head = HeadChunking("lm_head", 64, "recompute", "pure", vocab_rows=1024)
    plan = Plan(units=(UnitDecision("lm_head", "keep", weights="host"),),
                strategy="stream-weights", budget_bytes=1 << 30, host_optimizer=True,
                head=head)  # fmt: skip
    assert Plan.from_json(plan.to_json()) == plan
    plain = Plan(units=plan.units, strategy="eager", budget_bytes=1, head=HeadChunking("h", 8))
    assert "vocab_rows" not in plain.to_dict()["head"]  # what older builds read
    assert Plan.from_dict(plain.to_dict()) == plain
    with pytest.raises(ConfigError, match="vocabulary slices"):
        HeadChunking("h", 8, "grad-in-forward", "pure", vocab_rows=16)


# --- a tiny Llama ------------------------------------------------------------------------------
VOCAB, SEQ = 32000, 64
_UNITS = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")


def _llama(**overrides: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
        attn_implementation="sdpa", **overrides,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(step))
    labels = ids.clone()
    labels[:, :16] = -100  # a prompt without a loss
    return {"input_ids": ids, "labels": labels}


_HEAD = HeadChunking("lm_head", 64, "recompute", "pure", vocab_rows=MIN_VOCAB_ROWS)


def _streamed_plan(prefix: str = "", streamed: tuple[str, ...] = _UNITS) -> Plan:
    units = tuple(
        UnitDecision(prefix + f, "keep", weights="host" if f in streamed else "device")
        for f in _UNITS
    )
    head = HeadChunking(prefix + _HEAD.fqn, _HEAD.chunk_tokens, vocab_rows=_HEAD.vocab_rows,
                        mode="recompute", impl="pure")  # fmt: skip
    return Plan(units=units, strategy="stream-weights", budget_bytes=1 << 30,
                host_optimizer=True, head=head)  # fmt: skip


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def _train_both(eager: nn.Module, ours: nn.Module, plan: Plan, steps: int = 5) -> Any:
    """``eager``: the same vocabulary-sliced loss on resident weights, the device's AdamW."""
    trainable = [p for p in eager.parameters() if p.requires_grad]
    opt = _adamw(trainable)
    assert plan.head is not None
    resident = chunk_head(eager, HeadChunking(plan.head.fqn, 64, vocab_rows=MIN_VOCAB_ROWS))
    handle = apply_plan(ours, plan, optimizer_factory=_adamw)
    assert handle.optimizer is not None
    for step in range(steps):
        opt.zero_grad()
        eager(**_batch(step)).loss.backward()
        opt.step()
        ours(**_batch(step)).loss.backward()
        handle.optimizer.step()
    resident.remove()
    return handle


def _assert_equal(eager: nn.Module, ours: nn.Module) -> None:
    for (fqn, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), fqn


def test_tiny_llama_streaming_every_unit_and_the_head_in_slices_trains_bitwise() -> None:
    torch.set_num_threads(1)
    eager, ours = _llama(), _llama()
    seen: list[int] = []  # the head's .grad when autograd's hook runs: the host buffer itself
    ours.lm_head.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.data_ptr()))
    handle = _train_both(eager, ours, _streamed_plan())
    stream = handle.weights
    assert stream is not None and handle.buckets is not None
    rows = stream.rows_of(ours.lm_head.weight)
    assert rows is not None and rows.last_gradient is not None
    assert len(seen) == 5 and seen[-1] == rows.last_gradient.buffer_ptr  # never copied
    assert stream.stats().device_bytes == 0
    handle.remove()
    _assert_equal(eager, ours)
    # the first step's loss is the unchunked loss within 1e-6 (not bitwise: online log-sum-exp)
    fresh = _llama()
    reference = fresh(**_batch(0)).loss
    with apply_plan(fresh, _streamed_plan(), optimizer_factory=_adamw):
        assert _relative(fresh(**_batch(0)).loss.detach(), reference.detach()) <= 1e-6


def test_clipping_and_accumulation_see_the_head_gradient_on_the_host() -> None:
    """Two micro-batches summed and clipped: the head's host gradient gets the first one's sum
    and its norm on the host, bitwise as eager ``.grad`` and ``clip_grad_norm_``."""
    from superneurons.memory.plan import TrainingStep

    torch.set_num_threads(1)
    step = TrainingStep(max_grad_norm=0.5, accumulation_steps=2)
    eager, ours = _llama(), _llama()
    opt = _adamw(list(eager.parameters()))
    resident = chunk_head(eager, _HEAD)
    handle = apply_plan(ours, replace(_streamed_plan(), step=step), optimizer_factory=_adamw)
    assert handle.optimizer is not None and handle.buckets is not None
    micro = [0]
    handle.buckets.sync = lambda: micro[0] == 1
    norms = []
    for s in range(2):
        opt.zero_grad()
        handle.optimizer.zero_grad()
        for m in range(2):
            micro[0] = m
            (eager(**_batch(2 * s + m)).loss / 2).backward()
            (ours(**_batch(2 * s + m)).loss / 2).backward()
            assert ours.lm_head.weight.grad is None  # taken by its bucket, on the host
        norms.append((
            torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5),
            handle.optimizer.clip_grad_norm_(0.5, 2.0, ours.parameters()),
        ))  # fmt: skip
        opt.step()
        handle.optimizer.step()
    resident.remove()
    handle.remove()
    assert all(torch.equal(a, b) for a, b in norms), norms
    _assert_equal(eager, ours)


def test_lora_on_a_frozen_base_streams_the_head_slices_with_no_gradient() -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0)  # fmt: skip

    def lora() -> nn.Module:
        model = _llama()
        torch.manual_seed(0)
        return peft.get_peft_model(model, config)

    eager, ours = lora(), lora()
    head = ours.base_model.model.lm_head.weight
    before = head.detach().clone()
    handle = _train_both(eager, ours, _streamed_plan("base_model.model."))
    assert handle.weights is not None
    rows = handle.weights.rows_of(head)
    assert rows is not None and rows.last_gradient is None  # fetched, never a gradient
    assert rows.counters["fetches"] > 0 and head.grad is None
    handle.remove()
    _assert_equal(eager, ours)
    assert torch.equal(head, before)  # the frozen head is untouched


def test_a_tied_head_is_refused_and_leaves_no_trace() -> None:
    model = _llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="tied"):
        apply_plan(model, _streamed_plan(), optimizer_factory=_adamw)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert "forward" not in model.lm_head.__dict__ and "forward" not in model.__dict__


@pytest.mark.cuda
def test_streaming_the_head_in_slices_on_cuda_equals_the_resident_plan_bitwise() -> None:
    """Side stream, pinned host copy and gradient buffer, events: the same bits as the same
    plan with every weight resident."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    resident, streamed = _llama().cuda(), _llama().cuda()
    handles = [
        apply_plan(resident, _streamed_plan(streamed=()), optimizer_factory=_adamw),
        apply_plan(streamed, _streamed_plan(), optimizer_factory=_adamw),
    ]
    for step in range(3):
        batch = {k: v.cuda() for k, v in _batch(step).items()}
        for model, handle in zip((resident, streamed), handles, strict=True):
            model(**batch).loss.backward()
            handle.optimizer.step()  # type: ignore[union-attr]
    assert streamed.lm_head.weight.device.type == "cpu"  # between steps: the host copy
    assert streamed.lm_head.weight.is_pinned()
    for handle in handles:
        handle.remove()
    _assert_equal(resident, streamed)


# --- the floor and the measured peak (five profiles of the step) ------------------------------
def test_tiny_llama_floor_against_the_host_optimizer_and_measured_peak() -> None:
    from superneurons.bench.memory.meter import device_peak_bytes
    from superneurons.memory import make_plan, profile_step
    from superneurons.memory.planner.decide import search_floors
    from superneurons.memory.profiling.below import below_profiles

    torch.set_num_threads(1)

    class _Step(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.model(**inputs).loss

    step = _Step(_llama())
    batch = {"input_ids": _batch(1)["input_ids"], "labels": _batch(1)["input_ids"].clone()}
    options: dict[str, Any] = dict(fake=False, keep_output=False)

    def loss(out: torch.Tensor, _targets: Any) -> torch.Tensor:
        return out

    plain = profile_step(step, batch, None, loss, _adamw(step.parameters()), **options)
    chunked = below_profiles(
        step, batch, None, loss, _adamw(step.parameters()), profile=plain, tokens=SEQ,
        seq_len=SEQ, **options,
    )  # fmt: skip
    assert chunked[-1].head is not None and chunked[-1].head.vocab_rows == MIN_VOCAB_ROWS
    floors = search_floors(plain, chunked=chunked).peak_bytes()
    # the vocabulary slices serve stream-weights only: every other floor is what it was
    before = search_floors(
        plain, chunked=[c for c in chunked if not c.head or not c.head.vocab_rows]
    )
    assert {k: v for k, v in floors.items() if k != "stream-weights"} == {
        k: v for k, v in before.peak_bytes().items() if k != "stream-weights"
    }
    stream, host = floors["stream-weights"], floors["offload+host-optimizer"]
    message = (
        f"stream-weights floor {stream} B / host optimizer's floor {host} B = {stream / host:.3f}"
        f" (without vocabulary slices: {before.peak_bytes()['stream-weights'] / host:.3f})"
    )
    print(message)  # shown with pytest -s
    assert stream / host <= 0.5, message

    plan = make_plan(plain, budget_bytes=stream, strategy="stream-weights", chunked=chunked)
    assert (
        plan.head is not None and plan.head.vocab_rows and "model.lm_head" in plan.streamed_units()
    )
    handle = apply_plan(step, plan, optimizer_factory=_adamw)
    assert handle.optimizer is not None and handle.weights is not None

    def one() -> None:
        step(batch).backward()
        handle.optimizer.step()  # type: ignore[union-attr]

    one()
    streamed = {id(w.param) for w in handle.weights.weights}
    resident = [p for p in step.parameters() if id(p) not in streamed]
    host = [*handle.pool.host_buffers(), *handle.weights.host_buffers()]
    measured = device_peak_bytes(
        one, resident=[*resident, *step.buffers(), batch["input_ids"]], host=host
    )
    handle.remove()
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes, (
        measured,
        plan.predicted_peak_bytes,
    )
