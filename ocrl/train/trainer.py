"""The trainer: turns batches of samples into optimizer steps and publishes each new policy.

It sees samples (token ids, a loss mask and rollout log-probs per response token, a reward),
never sessions or HTTP. It reaches the engine only through `update_weights` (the new weights
under a new `weights_version`) and `score` (a teacher-forced probe that proves the swap landed).

The trainer owns its own float32 copy of the model, so training never touches the weights being
served. With LoRA the served weights are the merged ones (W + scale * B @ A) and the reference
policy is the same model with its adapters off; with full fine-tuning the reference is a frozen
copy of the starting weights.

One step (`step`), in order:
 1. pack the batch into micro-batches under a token budget (a long sample goes alone);
 2. per micro-batch: reference log-probs (no grad) of the samples that have none prefetched,
    then the policy forward; old log-probs; the policy loss; backward, weighted so the
    accumulated gradient is the full-batch one;
 3. clip the gradient norm, one AdamW step;
 4. merge the weights and publish them to the engine as version + 1;
 5. score a probe (the batch's first sample) on the engine and compare with our own log-probs;
 6. record the metrics row and the consumed sample ids; publish TrainStep.

Serving comes first. The trainer shares the CPU cores with the engine, and a user waiting for
tokens matters more than a step finishing sooner, so the torch work of a step stops at yield
points (before each micro-batch, before the probe, and before each decoder layer, forward and
backward) while `yield_to()` says the engine is busy, up to `train_yield_max` seconds per
step; after that it proceeds, so training never starves under constant load.

While `run` waits for a batch to fill (most of the time, online), it prefetches the reference
log-probs of each pending sample, one sample at a time and only while serving is idle: the
reference never changes, so they are the numbers the step would compute, off its critical
path. A prefetch gives way at once when a request arrives (it is abandoned and redone later).
The probe cannot be prefetched or reused from the step: it must be scored with the weights
after the optimizer step.

"Recompute" old log-probs are taken from the policy forward of step 2, detached: each batch
gets exactly one optimizer step and the weights do not move between micro-batches, so that
forward *is* the current policy before the update, and a separate no-grad pass would give the
same numbers at the cost of one more forward (ratio = 1 exactly, as in on-policy PPO).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
import shutil
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import torch

from ocrl import memory
from ocrl.faults import crash_point
from ocrl.train.loss import (
    combined_advantages,
    entropy_from_logits,
    grpo_advantages,
    masked_mean_per_sample_then_batch,
    opd_advantages,
    policy_loss,
    token_logprobs,
    topk_reverse_kl,
)
from ocrl.train.reference_prefix import ReferencePrefix
from ocrl.types import Progress, Sample, TrainStep, WeightsSwapped

log = logging.getLogger("ocrl.train")

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEEP_CHECKPOINTS = 3
ADAPTER = "default"  # peft's name for the one adapter we train

METRIC_KEYS = (
    "step", "weights_version", "loss", "pg_loss", "kl", "clip_frac", "ratio_mean", "ratio_max",
    "entropy", "mismatch", "grad_norm", "reward_mean", "masked_fraction", "tokens", "samples",
    "step_seconds", "yield_seconds", "swap_seconds",
)  # fmt: skip

_CHECKPOINT = re.compile(r"^step-(\d+)$")
YIELD_POLL = 0.005  # seconds between looks at the engine while a step gives way
PREFETCH_POLL = 0.02  # seconds between looks at the engine while a prefetch waits to start
DISK_POLL = 1.0  # seconds between looks at the records while the disk is full
_ENGINE = object()  # yield_to's default: ask the engine (see `serving`)


class _NoRecords:
    dir = None
    full = False

    def metric(self, row: dict) -> None:
        pass

    def distill(self, rows: list[dict]) -> None:
        pass

    def consumed(self, sample_ids: list[str], step: int | None = None) -> None:
        pass

    def forget_token_ids(self, through_step: int, keep: int = 0) -> int:
        return 0


class _NoEvents:
    def publish(self, event) -> None:
        pass

    def log(self, level: str, message: str) -> None:
        pass


def serving(engine) -> Callable[[], bool] | None:
    """True while `engine` has a request decoding or queued; None for an engine that cannot say."""
    if hasattr(engine, "active") and hasattr(engine, "queue_depth"):
        return lambda: engine.active > 0 or engine.queue_depth > 0
    return None


class _Preempted(Exception):
    """Raised at a yield point to abandon work that can be redone later (a prefetch)."""


class _GiveWay:
    """A step's yield points: each waits while serving is busy, within `budget` seconds in
    total, then lets the step proceed so that training never starves."""

    def __init__(self, busy: Callable[[], bool], budget: float):
        self.busy = busy
        self.budget = budget
        self.spent = 0.0  # seconds waited so far

    def __call__(self) -> None:
        if self.spent >= self.budget or not self.busy():
            return
        started = time.perf_counter()
        while self.busy() and self.spent + (time.perf_counter() - started) < self.budget:
            time.sleep(YIELD_POLL)
        self.spent += time.perf_counter() - started


def train_device(model) -> torch.device:
    """The trainer works where the served model sits (the GPU on a GPU box, else the CPU)."""
    return next(model.parameters()).device


def verify_tolerance(model) -> float:
    """Largest served-vs-trainer log-prob gap on the probe that still counts as the same
    weights: an fp32 engine agrees with the fp32 trainer to ~1e-6; a 16-bit engine rounds every
    activation, so its gap is that rounding (0.25 is a guess until measured on a GPU)."""
    return 1e-3 if next(model.parameters()).dtype == torch.float32 else 0.25


PROBE_ULPS = 8  # how many units of the engine dtype's precision a probe log-prob may be off by


def verify_relative(model) -> float:
    """The probe's tolerance relative to each log-prob's own size, for a 16-bit engine: 8 units
    of its precision (bf16 keeps 8 significant bits, so eps = 2^-7 and 8 eps = 6.25%; fp16 eps
    2^-10). A served log-prob is a logit minus a log-sum-exp, both about as large as the
    log-prob itself (ln of the vocabulary, ~12, on a near-uniform random model), each rounded
    through every layer, so the engine-vs-fp32-trainer gap grows with |log-prob|, not as a fixed
    number: on an H200, bf16 qwen3 probes at |lp| ~12 differed by 0.13-0.28, i.e. 2-4.5 units
    of bf16 at that size (spacing 2^-4 between 8 and 16), which a flat 0.25 sat right on. A
    swap that did not land, or landed garbage, moves log-probs by whole nats, far past 8 units.
    fp32 engines: 0 (their flat 1e-3 already sits ~1000x above the observed 1e-6)."""
    dtype = next(model.parameters()).dtype
    return 0.0 if dtype == torch.float32 else PROBE_ULPS * torch.finfo(dtype).eps


def _proceed() -> None:
    pass


@dataclass
class _Teacher:
    """The teacher (the reference with hints in its prompt) on one sample's response tokens."""

    logprobs: torch.Tensor  # (R,) log pi_teacher(a_t | s + hint)
    top_ids: torch.Tensor | None = None  # (R, K) with --distill-topk K
    top_logprobs: torch.Tensor | None = None  # (R, K)


@dataclass(eq=False)
class _Pending:
    """A sample waiting for its batch, with its reference (and teacher) log-probs once prefetched."""

    sample: Sample
    reference: torch.Tensor | None = None  # (R,)
    teacher: _Teacher | None = None
    prefetched: bool = False  # everything the step would compute for it is here


def sample_problem(sample: Sample, *, untrained_ok: bool = False) -> str | None:
    """Why a sample cannot be trained on, or None if it can. `untrained_ok`: a mask-0 sample may
    come too (--batch-counts all: it fills the batch and trains nothing)."""
    n = sample.response_length
    if n < 1 or n >= len(sample.tokens):
        return f"response_length {n} must be in [1, {len(sample.tokens)}) (a prompt token first)"
    if len(sample.loss_mask) != n or len(sample.rollout_logprobs) != n:
        return f"loss_mask/rollout_logprobs lengths {len(sample.loss_mask)}/{len(sample.rollout_logprobs)} != {n}"
    if not sample.effective and not untrained_ok:
        return "no masked-in token"
    return None


def split_prompt(sample: Sample) -> tuple[list[int], list[int]]:
    cut = len(sample.tokens) - sample.response_length
    return list(sample.tokens[:cut]), list(sample.tokens[cut:])


def teacher_view(sample: Sample) -> Sample:
    """The sample as the teacher reads it: the same response ids after the hinted prompt."""
    return _probe_sample(sample.teacher_prompt_ids, split_prompt(sample)[1])


def _probe_sample(prompt_ids: list[int], response_ids: list[int]) -> Sample:
    """Token ids only: what a swap probe needs, and all a checkpoint keeps of one."""
    n = len(response_ids)
    return Sample(
        sample_id="probe",
        session_id="",
        turn_index=-1,
        tokens=list(prompt_ids) + list(response_ids),
        response_length=n,
        loss_mask=[1] * n,
        rollout_logprobs=[0.0] * n,
        reward=0.0,
        weights_version=-1,
        score=None,
    )


@dataclass
class _MicroBatch:
    """Samples left-padded to one width; response tensors right-aligned to R columns.

    Left padding puts every response at the end of its row, so the logits of the last R + 1
    positions cover every response token and the (often long) prompts cost no vocab projection.
    """

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, R) the response ids
    loss_mask: torch.Tensor  # (B, R)
    rollout_logprobs: torch.Tensor  # (B, R)
    rewards: torch.Tensor  # (B,)

    @classmethod
    def of(cls, samples: list[Sample], device: torch.device) -> "_MicroBatch":
        width = max(len(s.tokens) for s in samples)
        span = max(s.response_length for s in samples)
        ids = torch.zeros((len(samples), width), dtype=torch.long)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        loss_mask = torch.zeros((len(samples), span), dtype=torch.long)
        rollout = torch.zeros((len(samples), span), dtype=torch.float32)
        for row, sample in enumerate(samples):
            n, r = len(sample.tokens), sample.response_length
            ids[row, width - n :] = torch.tensor(sample.tokens)
            attention[row, width - n :] = 1
            loss_mask[row, span - r :] = torch.tensor(sample.loss_mask)
            rollout[row, span - r :] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        return cls(
            *(t.to(device) for t in (ids, attention, positions, ids[:, width - span :], loss_mask, rollout, rewards))
        )


def pack(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """Greedy micro-batches whose padded size (rows x longest row) fits `budget` tokens.

    Longest first, so each group's width is its first sample; a sample over budget goes alone.
    """
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    for sample in sorted(samples, key=lambda s: len(s.tokens), reverse=True):
        if current and (len(current) + 1) * len(current[0].tokens) > budget:
            groups.append(current)
            current = []
        current.append(sample)
    if current:
        groups.append(current)
    return groups


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a transformer: the longest ModuleList in it."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _engine_name(module_name: str) -> str:
    """peft's module path -> the plain model's: drop the wrapper prefix and `.base_layer`."""
    return module_name.removeprefix("base_model.model.").replace(".base_layer", "")


class Trainer:
    def __init__(
        self,
        config,
        model,
        *,
        engine,
        records=None,
        events=None,
        device: str | torch.device = "cpu",
        verify_atol: float = 1e-3,
        verify_rtol: float = 0.0,
        yield_to: Callable[[], bool] | None = _ENGINE,  # type: ignore[assignment]
    ):
        self.config = config
        self.engine = engine
        # True while serving needs the cores; by default, while the engine decodes or queues
        self.yield_to = (serving(engine) if yield_to is _ENGINE else yield_to) or (lambda: False)
        self.records = records if records is not None else _NoRecords()
        self.events = events if events is not None else _NoEvents()
        self.device = torch.device(device)
        self.verify_atol = verify_atol  # fp32 engines agree to ~1e-6; a bf16 engine needs more
        self.verify_rtol = verify_rtol  # and a 16-bit one's gap grows with |log-prob| (verify_relative)
        self.lora = config.lora_rank > 0 and not config.full_finetune
        self.model, self.reference = self._build(model)
        # the reference never changes: its KV for a session's earlier turn serves the next turn
        self.reference_prefix = ReferencePrefix(getattr(config, "prefix_cache", "0"), self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
        )
        self.steps = 0
        self.version = 0  # the weights_version the engine last acknowledged from us
        self.consumed_samples = 0
        self.last_metrics: dict[str, float] = {}
        self.probe: Sample | None = None  # the last step's first sample: proves each swap landed
        self.distilled_rows: list[dict] = []  # the last step's distilled samples and their teacher advantages
        if config.save_dir:
            self.save_dir: Path | None = Path(config.save_dir)
        elif getattr(self.records, "dir", None) is not None:
            self.save_dir = Path(self.records.dir) / "checkpoints"
        else:
            self.save_dir = None
        self._saved_step = 0
        self._lock = anyio.Lock()  # a step, a prefetch and a checkpoint never interleave
        self._pending: list[_Pending] = []
        self._paused = False
        self.waiting_for_disk = False  # steps wait while the records cannot be written
        self._wake = anyio.Event()  # for the step loop: a sample arrived, or resume
        self._arrived = anyio.Event()  # for the prefetch: the same
        # Called at every yield point in the torch work: a step waits there, a prefetch gives up.
        self._give_way: Callable[[], None] = _proceed
        for layers in (_decoder_layers(self.model), _decoder_layers(self.reference) if self.reference else []):
            for layer in layers:
                layer.register_forward_pre_hook(self._layer_yield_point, with_kwargs=True)

    # -- model ------------------------------------------------------------------------------

    def _build(self, model):
        base = copy.deepcopy(model).to(device=self.device, dtype=torch.float32)
        if getattr(base.config, "_attn_implementation", None) == "flash_attention_2":
            # flash-attention takes only 16-bit inputs; the trainer's fp32 copy attends with SDPA
            base.set_attn_implementation("sdpa")
        base.eval()  # no dropout: the policy we train must be the one the engine samples from
        if not self.lora:
            base.requires_grad_(True)
            # the frozen copy serves the KL and the teacher; --kl-coef 0 with rl needs neither
            needed = self.config.kl_coef != 0 or self.config.method != "rl"
            return base, (copy.deepcopy(base).requires_grad_(False) if needed else None)
        from peft import LoraConfig, get_peft_model

        names = [name for name, _ in base.named_modules()]
        targets = [t for t in LORA_TARGETS if any(n.endswith("." + t) for n in names)] or "all-linear"
        lora = LoraConfig(
            r=self.config.lora_rank,
            lora_alpha=self.config.lora_alpha,
            target_modules=targets,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(self.config.seed)  # the adapter's init follows config.seed only
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(base, lora), None

    def _layer_yield_point(self, module, args, kwargs) -> None:
        """Before a decoder layer's forward, and (through a hook on its input) after its backward."""
        self._give_way()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: self._give_way())

    def _preempt(self) -> None:
        if self.yield_to():
            raise _Preempted

    def _reference_mode(self):
        """The model to run for reference log-probs, and the context that makes it the base."""
        if self.lora:
            return self.model, self.model.disable_adapter()
        return self.reference, contextlib.nullcontext()

    def _forward(self, model, batch: _MicroBatch, entropy: bool = False, full: bool = False):
        """Log-probs of the response tokens (B, R) and, with `entropy`, their entropy (B, R), else
        None; with `full`, a third item: the whole log-softmax (B, R, V), which top-K
        distillation reads."""
        span = batch.targets.shape[1]
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
            logits_to_keep=span + 1,
        )
        logits = out.logits[:, :-1]  # (B, R, V): position t predicts response token t
        if full:
            every = torch.log_softmax(logits.float(), dim=-1)  # (B, R, V)
            logprobs = every.gather(-1, batch.targets.long().unsqueeze(-1)).squeeze(-1)  # (B, R)
        else:
            every, logprobs = None, token_logprobs(logits, batch.targets)  # (B, R)
        ent = None
        if entropy and self.config.entropy_coef:
            ent = entropy_from_logits(logits)  # (B, R)
        elif entropy:
            with torch.no_grad():  # reported only: no graph for it
                ent = entropy_from_logits(logits.detach())
        return (logprobs, ent, every) if full else (logprobs, ent)

    @torch.no_grad()
    def response_logprobs(self, samples: list[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        """Teacher-forced log-probs of each sample's response, one (R,) tensor per sample,
        under the trained policy or (reference=True) the reference. One sample at a time, so
        there is no padding and the numbers match the engine's `score`. The reference reuses its
        own work on a session's earlier turns (see reference_prefix.py)."""
        out = []
        for sample in samples:
            if not reference:
                out.append(self._forward(self.model, _MicroBatch.of([sample], self.device))[0][0].cpu())
                continue
            model, mode = self._reference_mode()
            with mode:
                if self.reference_prefix.enabled:
                    out.append(self.reference_prefix.logprobs(model, sample).cpu())
                else:
                    out.append(self._forward(model, _MicroBatch.of([sample], self.device))[0][0].cpu())
        return out

    @torch.no_grad()
    def teacher_logprobs(self, samples: list[Sample]) -> list[_Teacher]:
        """The teacher on each distilled sample: the reference (adapters off, or the frozen copy)
        scoring the sample's response ids after its hinted prompt, one sample at a time; with
        --distill-topk K also its K most likely tokens at every response position."""
        k = self.config.distill_topk
        model, mode = self._reference_mode()
        out = []
        with mode:
            for sample in samples:
                batch = _MicroBatch.of([teacher_view(sample)], self.device)
                if k > 0:
                    logprobs, _, every = self._forward(model, batch, full=True)
                    top = every[0].topk(k, dim=-1)
                    out.append(_Teacher(logprobs[0].cpu(), top.indices.cpu(), top.values.cpu()))
                else:
                    logprobs, _ = self._forward(model, batch)
                    out.append(_Teacher(logprobs[0].cpu()))
        return out

    @torch.no_grad()
    def published_weights(self) -> dict[str, torch.Tensor]:
        """What the engine needs to serve the current policy, named as in the plain model.

        LoRA: only the adapted linear weights, merged (W + scale * B @ A) into new tensors; the
        training model is left as it is; to an engine that `accepts_adapters` (`--weight-sync
        lora`), the adapter itself, named as peft saves it. Full fine-tuning: every parameter
        (views, not copies: the engine copies them while we hold the step lock).
        """
        if not self.lora:
            return {name: p.detach() for name, p in self.model.named_parameters()}
        if getattr(self.engine, "accepts_adapters", False):
            from peft import get_peft_model_state_dict

            return {name: t.detach().clone() for name, t in get_peft_model_state_dict(self.model, adapter_name=ADAPTER).items()}
        from peft.tuners.lora import LoraLayer

        merged = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                weight = module.get_base_layer().weight.detach()
                merged[_engine_name(name) + ".weight"] = weight + module.get_delta_weight(ADAPTER).to(weight.dtype)
        return merged

    # -- one step ---------------------------------------------------------------------------

    def _reference_rows(
        self, group: list[Sample], micro: _MicroBatch, prefetched: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """Reference log-probs of `group` as (B, R), laid out like `micro`: the prefetched
        ones as they are, the others from one no-grad forward of just those samples (a sample
        alone, i.e. a long one, through the reference's prefix cache)."""
        missing = [s for s in group if id(s) not in prefetched]
        if len(missing) == 1 and self.reference_prefix.enabled:
            prefetched = prefetched | {id(missing[0]): self.response_logprobs(missing, reference=True)[0]}
        elif missing:
            # none prefetched (the common cold case): the group's own micro-batch serves as is
            missing_micro = micro if len(missing) == len(group) else _MicroBatch.of(missing, self.device)
            model, mode = self._reference_mode()
            with torch.no_grad(), mode:
                computed, _ = self._forward(model, missing_micro)  # (b, r)
            if missing_micro is micro:
                return computed
            width = computed.shape[1]
            prefetched = prefetched | {id(s): computed[row, width - s.response_length :] for row, s in enumerate(missing)}
        span = micro.targets.shape[1]
        rows = torch.zeros((len(group), span), dtype=torch.float32, device=self.device)  # (B, R)
        for row, sample in enumerate(group):
            rows[row, span - sample.response_length :] = prefetched[id(sample)].to(self.device)
        return rows

    def _teacher_rows(self, group: list[Sample], micro: _MicroBatch, prefetched: dict[int, _Teacher]):
        """The teacher laid out like `micro`: log-probs (B, R), which rows are distilled (B,), and
        with --distill-topk K the top-K ids and log-probs (B, R, K); computed where not prefetched."""
        span, k = micro.targets.shape[1], self.config.distill_topk
        missing = [s for s in group if s.distilled and id(s) not in prefetched]
        if missing:
            prefetched = prefetched | dict(zip(map(id, missing), self.teacher_logprobs(missing)))
        logprobs = torch.zeros((len(group), span), dtype=torch.float32)  # (B, R)
        distilled = torch.zeros(len(group), dtype=torch.bool)  # (B,)
        top_ids = torch.zeros((len(group), span, max(k, 1)), dtype=torch.long)  # (B, R, K)
        top_logprobs = torch.zeros((len(group), span, max(k, 1)), dtype=torch.float32)  # (B, R, K)
        for row, sample in enumerate(group):
            if not sample.distilled:
                continue
            teacher, r = prefetched[id(sample)], sample.response_length
            distilled[row] = True
            logprobs[row, span - r :] = teacher.logprobs
            if k > 0:
                top_ids[row, span - r :] = teacher.top_ids
                top_logprobs[row, span - r :] = teacher.top_logprobs
        device = self.device
        return logprobs.to(device), distilled.to(device), top_ids.to(device), top_logprobs.to(device)

    def _advantages(self, micro: _MicroBatch, old: torch.Tensor, teacher: torch.Tensor, distilled: torch.Tensor) -> torch.Tensor:
        """A_t by method: rl r; opd teacher - old; combine w_rl r + w_opd (teacher - old). With
        --distill-topk the teacher term leaves the advantage for the top-K loss."""
        config = self.config
        rl = grpo_advantages(micro.rewards, micro.loss_mask)  # (B, R)
        if config.method == "rl":
            return rl
        w_rl = config.w_rl if config.method == "combine" else 0.0
        if config.distill_topk > 0:
            return w_rl * rl
        if config.method == "opd":
            return opd_advantages(teacher, old, micro.loss_mask) * distilled.float().unsqueeze(-1)
        return combined_advantages(micro.rewards, teacher, old, micro.loss_mask, distilled, w_rl=config.w_rl, w_opd=config.w_opd)

    def accumulate_gradients(
        self, batch: list[Sample], references: list[torch.Tensor | None] | None = None, teachers: list[_Teacher | None] | None = None,
        *, count: int | None = None,
    ) -> dict[str, float]:
        """Backward the full-batch policy loss over micro-batches; returns its diagnostics.

        `references` holds each sample's prefetched (R,) reference log-probs, or None where the
        step must compute them; `teachers` the same for distilled samples (--method opd|combine).
        policy_loss takes a token mean per sample, then a mean over samples; weighting each
        micro-batch's loss by its share of the batch's samples makes the accumulated gradient
        equal to the one-big-batch gradient. The top-K distillation term is a mean over the
        distilled samples of a micro-batch, weighted by their share of the batch.

        `count` (default len(batch)) is what the summed per-sample means are divided by: with
        --batch-counts all, the whole batch the step drew, mask-0 samples included, as the
        reference divides by its global batch size. With --kl-coef 0 no reference log-probs are
        computed at all (the KL term would be multiplied by 0).
        """
        config = self.config
        distill = config.method != "rl"
        topk = distill and config.distill_topk > 0
        w_distill = config.w_opd if config.method == "combine" else 1.0
        self.optimizer.zero_grad(set_to_none=True)
        total = count or len(batch)
        prefetched = {id(s): r for s, r in zip(batch, references or []) if r is not None}
        taught = {id(s): t for s, t in zip(batch, teachers or []) if t is not None}
        by_sample: dict[str, float] = defaultdict(float)  # sample-mean metrics, weighted sums
        by_token: dict[str, float] = defaultdict(float)  # token-mean metrics, weighted sums
        tokens = 0
        ratio_max = 0.0
        self.distilled_rows = []
        for group in pack(batch, config.micro_batch_tokens):
            self._give_way()
            micro = _MicroBatch.of(group, self.device)
            mask = micro.loss_mask.bool()  # (B, R)
            ref_logprobs = self._reference_rows(group, micro, prefetched) if config.kl_coef != 0 else None  # (B, R)
            if distill:
                teacher, distilled, top_ids, top_logprobs = self._teacher_rows(group, micro, taught)
            self._give_way()
            if topk:
                logprobs, entropy, every = self._forward(self.model, micro, entropy=True, full=True)  # (B, R), (B, R, V)
            else:
                logprobs, entropy = self._forward(self.model, micro, entropy=True)  # (B, R)
            old = logprobs.detach() if config.old_logprobs == "recompute" else micro.rollout_logprobs
            loss, metrics = policy_loss(
                logprobs,
                old,
                self._advantages(micro, old, teacher, distilled) if distill else grpo_advantages(micro.rewards, micro.loss_mask),
                micro.loss_mask,
                ref_logprobs,
                eps_clip=config.eps_clip,
                eps_clip_high=config.clip_high,
                kl_coef=config.kl_coef,
                entropy=entropy,
                entropy_coef=config.entropy_coef,
            )
            if distill:
                taught_mask = mask & distilled.unsqueeze(-1)  # (B, R)
                n_taught = int(distilled.sum())
                gap = torch.where(taught_mask, teacher - old, 0.0)  # (B, R) the teacher advantage
                by_token["teacher_advantage"] += gap.sum().item()
                by_token["_taught_tokens"] += int(taught_mask.sum())
                by_sample["distilled"] += n_taught
                for row, sample in enumerate(group):
                    if distilled[row]:
                        n = int(taught_mask[row].sum())
                        self.distilled_rows.append({
                            "sample_id": sample.sample_id, "hint": sample.hint, "experience": len(sample.experience),
                            "teacher_advantage": gap[row].sum().item() / max(n, 1), "tokens": n,
                        })
                if topk and n_taught:
                    kl = topk_reverse_kl(every, top_ids, top_logprobs, taught_mask)  # (B, R)
                    distill_kl = masked_mean_per_sample_then_batch(kl, taught_mask)  # mean over distilled samples
                    loss = loss + w_distill * distill_kl * (n_taught / len(group))
                    kl_value = distill_kl.item()
                    by_sample["distill_kl"] += kl_value * n_taught
                    metrics["loss"] += w_distill * kl_value * (n_taught / len(group))  # what was minimised
            (loss * (len(group) / total)).backward()

            n = int(mask.sum())
            gap = torch.where(mask, logprobs.detach() - micro.rollout_logprobs, 0.0).abs().sum().item()
            for key in ("loss", "pg_loss", "kl", "entropy"):
                by_sample[key] += metrics[key] * len(group)
            for key in ("clip_frac", "ratio_mean"):
                by_token[key] += metrics[key] * n
            by_token["mismatch"] += gap
            tokens += n
            ratio_max = max(ratio_max, metrics["ratio_max"])
        taught_tokens = by_token.pop("_taught_tokens", 0)
        teacher_total = by_token.pop("teacher_advantage", None)
        n_distilled = by_sample.pop("distilled", None)
        kl_total = by_sample.pop("distill_kl", None)
        out = {key: value / total for key, value in by_sample.items()}
        out |= {key: value / max(tokens, 1) for key, value in by_token.items()}
        out["ratio_max"] = ratio_max
        if distill:
            out["distilled"] = (n_distilled or 0) / total  # share of the batch with a teacher signal
            out["teacher_advantage"] = (teacher_total or 0.0) / max(taught_tokens, 1)  # token mean of teacher - old
            if topk:
                out["distill_kl"] = (kl_total or 0.0) / max(n_distilled or 0, 1)
        return out

    def _train(
        self, batch: list[Sample], references: list[torch.Tensor | None] | None = None, teachers: list[_Teacher | None] | None = None,
        count: int | None = None,
    ) -> tuple[dict[str, float], dict[str, torch.Tensor], torch.Tensor]:
        """The torch part of a step (a worker thread): gradients, clip, AdamW, merge, probe.
        Gives way to serving at its yield points; step_seconds excludes that wait."""
        started = time.perf_counter()
        self._give_way = give_way = _GiveWay(self.yield_to, self.config.train_yield_max)
        try:
            metrics = self.accumulate_gradients(batch, references, teachers, count=count)
            max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            if math.isfinite(metrics["grad_norm"]):
                self.optimizer.step()
            else:  # one poisoned batch must not wreck the weights being served
                log.warning("skipping the update: gradient norm is %s", metrics["grad_norm"])
            self.optimizer.zero_grad(set_to_none=True)
            tensors = self.published_weights()
            give_way()
            probe_logprobs = self.response_logprobs([self.probe])[0]
        finally:
            self._give_way = _proceed
        metrics["yield_seconds"] = give_way.spent
        metrics["step_seconds"] = time.perf_counter() - started - give_way.spent
        return metrics, tensors, probe_logprobs

    def _needs_prefetch(self, sample: Sample) -> bool:
        """Whether a step would run the reference for it: its KL term (unless --kl-coef 0) or
        its teacher (a distilled sample, --method opd|combine); never for a mask-0 sample."""
        if not sample.effective:
            return False
        return self.config.kl_coef != 0 or (sample.distilled and self.config.method != "rl")

    def _prefetch(self, entry: _Pending) -> None:
        """A pending sample's reference log-probs (unless --kl-coef 0) and, when it is distilled,
        its teacher's (a worker thread); left as it was when a request arrived meanwhile and the
        work was abandoned."""
        sample = entry.sample
        self._give_way = self._preempt
        try:
            reference = self.response_logprobs([sample], reference=True)[0] if self.config.kl_coef != 0 else None
            teacher = self.teacher_logprobs([sample])[0] if sample.distilled and self.config.method != "rl" else None
        except _Preempted:
            return
        finally:
            self._give_way = _proceed
        entry.reference, entry.teacher, entry.prefetched = reference, teacher, True

    async def step(self, batch: list[Sample], references: list[torch.Tensor | None] | None = None) -> dict[str, float]:
        """One optimizer step on `batch`, then publish, verify, record. Returns the metrics row.
        `references`: each sample's reference log-probs where already known, else None."""
        references = references if references is not None else [None] * len(batch)
        if len(references) != len(batch):
            raise ValueError(f"{len(references)} references for {len(batch)} samples")
        return await self._step([_Pending(s, r, prefetched=r is not None) for s, r in zip(batch, references)])

    async def _step(self, entries: list[_Pending]) -> dict[str, float] | None:
        """One step on `entries`. With --batch-counts all (rl) mask-0 samples may be among them:
        they count toward the batch and its divisor, but no forward runs on them; a batch of only
        those is consumed without an optimizer step (None is returned)."""
        drawn = [entry.sample for entry in entries]
        counts_untrained = self.config.counts_untrained
        for sample in drawn:
            if problem := sample_problem(sample, untrained_ok=counts_untrained):
                raise ValueError(f"sample {sample.sample_id}: {problem}")
        if not drawn:
            raise ValueError("empty batch")
        entries = [entry for entry in entries if entry.sample.effective]
        batch = [entry.sample for entry in entries]
        if not batch:
            self.records.consumed([s.sample_id for s in drawn])
            self.consumed_samples += len(drawn)
            log.info("a batch of %d mask-0 samples: consumed without a step", len(drawn))
            return None
        async with self._lock:
            # read under the lock: a prefetch in flight when the batch was taken has landed
            references = [entry.reference for entry in entries]
            teachers = [entry.teacher for entry in entries]
            for sample, reference in zip(batch, references):
                if reference is not None and reference.shape != (sample.response_length,):
                    raise ValueError(f"sample {sample.sample_id}: reference shape {tuple(reference.shape)}")
            # 1-3. micro-batched gradients, clip, AdamW; merged weights and our probe log-probs
            self.probe = _probe_sample(*split_prompt(batch[0]))
            metrics, tensors, probe_logprobs = await anyio.to_thread.run_sync(self._train, batch, references, teachers, len(drawn))
            crash_point("train_step")
            self.steps += 1
            self.consumed_samples += len(drawn)
            # 4-5. swap into the engine as the next version, and check it serves what we trained
            swap_seconds, verified, probe_diff = await self._publish(tensors, self.version + 1, probe_logprobs)
            # 6. record
            response_tokens = sum(s.response_length for s in drawn)
            metrics |= {
                "reward_mean": sum(s.reward for s in drawn) / len(drawn),
                # the share of response tokens that are trained on (loss_mask 1)
                "masked_fraction": sum(sum(s.loss_mask) for s in drawn) / response_tokens,
                "tokens": float(sum(len(s.tokens) for s in batch)),
                "samples": float(len(drawn)),
                "trained_samples": float(len(batch)),
                # the share of the trained samples whose reference work was done before the step
                "prefetched": sum(e.prefetched or not self._needs_prefetch(e.sample) for e in entries) / len(batch),
                "swap_seconds": swap_seconds,
                "verified": float(verified),
                "probe_diff": probe_diff,
            }
            self.last_metrics = metrics
            row = {"step": self.steps, "weights_version": self.version, **metrics}
            # consumed first: a reader that sees the metrics row sees the whole batch marked used
            self.records.consumed([s.sample_id for s in drawn], step=self.steps)
            self.records.metric(row)
            if self.distilled_rows:
                self.records.distill([{"step": self.steps, **r} for r in self.distilled_rows])
            self.events.publish(TrainStep(
                step=self.steps, weights_version=self.version, metrics=metrics,
                teacher_advantages={r["sample_id"]: r["teacher_advantage"] for r in self.distilled_rows},
            ))
            return row

    async def _publish(
        self, tensors: dict[str, torch.Tensor], version: int, probe_logprobs: torch.Tensor | None
    ) -> tuple[float, bool, float]:
        """Swap `tensors` into the engine as `version` and check the served log-probs of the
        probe against ours (`probe_logprobs`, None when there is no probe: not verified). A
        failed swap is reported, not raised: the next step sends all the changing weights
        again, so the engine catches up."""
        try:
            seconds = await self.engine.update_weights(tensors, version=version)
        except Exception as e:
            log.exception("weight swap to version %d failed", version)
            self.events.log("error", f"weight swap to version {version} failed: {type(e).__name__}: {e}")
            self.events.publish(WeightsSwapped(weights_version=self.version, seconds=0.0, verified=False))
            return 0.0, False, math.inf
        self.version = version
        probe_diff = math.nan
        over = True
        if self.probe is not None and probe_logprobs is not None:
            try:
                served = torch.tensor(await self.engine.score(*split_prompt(self.probe)), dtype=torch.float32)
                same = served.shape == probe_logprobs.shape
                probe_diff = (served - probe_logprobs).abs().max().item() if same else math.inf
                if same and probe_diff < math.inf:  # per token: the larger of the flat and the relative bound
                    limits = torch.clamp(self.verify_rtol * probe_logprobs.abs(), min=self.verify_atol)
                    over = bool(((served - probe_logprobs).abs() >= limits).any())
            except Exception:
                log.exception("scoring the probe of version %d failed", version)
                probe_diff = math.inf
        verified = probe_diff < math.inf and not over  # False when nothing was probed (nan) or scoring failed
        if probe_logprobs is not None and not verified:
            log.warning("swap to version %d did not verify: probe differs by %.3g", version, probe_diff)
            self.events.log("warning", f"weights version {version}: served log-probs differ by {probe_diff:.3g}")
        self.events.publish(WeightsSwapped(weights_version=version, seconds=seconds, verified=verified))
        return seconds, verified, probe_diff

    async def publish(self) -> bool:
        """Push the current weights to the engine under the current version (after a resume)."""
        async with self._lock:
            tensors = await anyio.to_thread.run_sync(self.published_weights)
            probe_logprobs = None
            if self.probe is not None:
                probe_logprobs = (await anyio.to_thread.run_sync(self.response_logprobs, [self.probe]))[0]
            _, verified, _ = await self._publish(tensors, self.version, probe_logprobs)
            return verified

    # -- the loop ---------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pending(self) -> int:
        return len(self._pending)

    def pause(self) -> None:
        """Stop taking steps; samples keep accumulating."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()
        self._arrived.set()

    async def run(self, samples) -> None:
        """Step on every `rollout_batch_size` samples from the stream until it closes or we are
        cancelled; checkpoint every `save_interval` steps and on the way out."""
        if self.steps and self.engine.weights_version != self.version:
            await self.publish()  # a resumed trainer serves what it restored
        closed = False

        async def read() -> None:
            nonlocal closed
            async with samples:
                async for sample in samples:
                    if problem := sample_problem(sample, untrained_ok=self.config.counts_untrained):
                        log.warning("dropping sample %s: %s", sample.sample_id, problem)
                        continue
                    self._pending.append(_Pending(sample))
                    self._wake.set()
                    self._arrived.set()
            closed = True
            self._wake.set()

        async def prefetch() -> None:
            """Reference log-probs of pending samples, oldest first, while serving is idle."""
            while True:
                entry = next((e for e in self._pending if not e.prefetched and self._needs_prefetch(e.sample)), None)
                if entry is None or self._paused:
                    await self._arrived.wait()
                    self._arrived = anyio.Event()
                    continue
                if self.yield_to():
                    await anyio.sleep(PREFETCH_POLL)
                    continue
                async with self._lock:  # never alongside a step's torch work
                    if entry in self._pending and not entry.prefetched:  # not taken by a step meanwhile
                        await anyio.to_thread.run_sync(self._prefetch, entry)

        size = max(1, self.config.rollout_batch_size)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(read)
                tasks.start_soon(prefetch)
                while True:
                    if self.records.full and len(self._pending) >= size and not self._paused:
                        # a step now could not mark its samples consumed (nor checkpoint): wait
                        # for the records to be writable again, then go on by ourselves
                        if closed:
                            tasks.cancel_scope.cancel()
                            break
                        self.waiting_for_disk = True
                        await anyio.sleep(DISK_POLL)
                        continue
                    self.waiting_for_disk = False
                    if self._paused or len(self._pending) < size:
                        if closed:
                            tasks.cancel_scope.cancel()  # the prefetch has nothing left to do
                            break
                        await self._wake.wait()
                        self._wake = anyio.Event()
                        continue
                    batch = self._pending[:size]
                    del self._pending[:size]
                    try:
                        with anyio.CancelScope(shield=True):  # a step is atomic: train, swap, record
                            stepped = await self._step(batch)
                    except Exception as e:  # the samples stay unconsumed in the journal
                        log.exception("training step failed")
                        self.events.log("error", f"training step failed: {type(e).__name__}: {e}")
                        continue
                    # the step's activations and gradients are freed: hand the pages back to the
                    # OS rather than leave them in glibc's arenas (see memory.py)
                    await anyio.to_thread.run_sync(memory.trim)
                    if stepped and self.config.save_interval > 0 and self.steps % self.config.save_interval == 0:
                        await self.save_checkpoint()
        finally:
            if self.steps > self._saved_step:
                with anyio.CancelScope(shield=True):
                    await self.save_checkpoint()

    # -- checkpoints ------------------------------------------------------------------------

    async def save_checkpoint(self) -> Path | None:
        """Write `<save_dir>/step-<n>` via a temporary directory and a rename; keep the newest 3."""
        if self.save_dir is None:
            return None
        if self.records.full:  # a checkpoint past consumed marks still owed would retrain them twice
            log.warning("checkpoint of step %d skipped: the record dir cannot be written", self.steps)
            return None
        async with self._lock:
            final = self.save_dir / f"step-{self.steps}"
            if self._saved_step == self.steps and final.exists():
                return final
            task = f"checkpoint step {self.steps}"
            staging = self.save_dir / f".step-{self.steps}.tmp"
            state = {
                "step": self.steps,
                "weights_version": self.version,
                "consumed_samples": self.consumed_samples,
                "lora": self.lora,
                "lora_rank": self.config.lora_rank if self.lora else 0,
                "saved_at": time.time(),
                # the probe is a sample's token ids, i.e. its conversation: not kept with --no-record-text
                "probe": list(split_prompt(self.probe)) if self.probe is not None and not self.config.no_record_text else None,
            }
            # 1. weights -> 2. optimizer -> 3. state, rename, prune; progress between stages
            self.events.publish(Progress(task=task, done=0, total=3))
            try:
                await anyio.to_thread.run_sync(self._write_weights, staging)
                self.events.publish(Progress(task=task, done=1, total=3))
                await anyio.to_thread.run_sync(_save_private, self.optimizer.state_dict(), staging / "optimizer.pt")
                self.events.publish(Progress(task=task, done=2, total=3))
                await anyio.to_thread.run_sync(self._finish_checkpoint, staging, final, state)
            except Exception as e:  # a full disk (OSError, or the writers own errors): the previous checkpoint stands
                shutil.rmtree(staging, ignore_errors=True)
                log.error("checkpoint of step %d failed (%s): the previous one stands", self.steps, e)
                self.events.log("error", f"checkpoint of step {self.steps} failed: {e}")
                self.events.publish(Progress(task=task, done=3, total=3))
                return None
            self.events.publish(Progress(task=task, done=3, total=3))
            self._saved_step = self.steps
            log.info("saved %s", final)
            if self.config.retain_samples >= 0:  # the checkpoint covers these samples now
                forgotten = self.records.forget_token_ids(self.steps, keep=self.config.retain_samples)
                if forgotten:
                    log.info("forgot the token ids of %d consumed samples (--retain-samples %d)", forgotten, self.config.retain_samples)
            return final

    def _write_weights(self, staging: Path) -> None:
        if staging.exists():
            shutil.rmtree(staging)
        staging.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging.parent.chmod(0o700)
        staging.mkdir(mode=0o700)
        if self.lora:
            self.model.save_pretrained(staging / "adapter")
        else:
            from safetensors.torch import save_model

            save_model(self.model, str(staging / "model.safetensors"))  # handles tied weights

    def _finish_checkpoint(self, staging: Path, final: Path, state: dict) -> None:
        crash_point("checkpoint")
        (staging / "state.json").write_text(json.dumps(state))
        # weights trained on people's conversations: owner only, whatever the umask
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o700 if path.is_dir() else 0o600)
        if final.exists():  # re-saving a step: swap the old one out, then drop it
            old = final.with_name(final.name + ".old")
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old)
        else:
            os.replace(staging, final)
        stale = checkpoints(final.parent)[:-KEEP_CHECKPOINTS] + list(final.parent.glob(".step-*.tmp"))
        for path in stale:  # older checkpoints, and staging left by a crash
            shutil.rmtree(path, ignore_errors=True)

    def load_latest(self, save_dir: str | Path | None = None) -> Path | None:
        """Restore weights, optimizer, step, version and consumed count from the newest complete
        checkpoint; None when there is none. Call before `run`, which then republishes."""
        directory = Path(save_dir) if save_dir else self.save_dir
        found = checkpoints(directory) if directory is not None else []
        if not found:
            return None
        path = found[-1]
        state = json.loads((path / "state.json").read_text())
        if state["lora"] != self.lora:
            raise ValueError(f"{path} holds {'a LoRA adapter' if state['lora'] else 'full weights'}; config disagrees")
        if self.lora:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            loaded = load_file(str(path / "adapter" / "adapter_model.safetensors"), device=str(self.device))
            result = set_peft_model_state_dict(self.model, loaded)
            if result.unexpected_keys:
                raise ValueError(f"{path}: adapter does not fit the model: {result.unexpected_keys[:3]}")
        else:
            from safetensors.torch import load_model

            load_model(self.model, str(path / "model.safetensors"), device=str(self.device))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=self.device))
        self.steps = self._saved_step = int(state["step"])
        self.version = int(state["weights_version"])
        self.consumed_samples = int(state["consumed_samples"])
        self.probe = _probe_sample(*state["probe"]) if state.get("probe") else None
        log.info("resumed from %s (step %d, weights version %d)", path, self.steps, self.version)
        return path


def _save_private(obj, path: Path) -> None:
    """torch.save into a file only its owner can read (optimizer moments mirror the weights)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints under `directory` (a state.json is written last), oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found) if (p / "state.json").exists()]
