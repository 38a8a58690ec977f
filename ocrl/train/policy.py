"""The policy the trainer trains, the frozen reference and teacher views of it, and their
log-prob forwards.

The trainer owns its own float32 copy of the model, so training never touches the weights being
served. With LoRA the served weights are the merged ones (W + scale * B @ A) and the reference
policy is the same model with its adapters off; with full fine-tuning the reference is a frozen
copy of the starting weights (kept only when the KL or a teacher reads it). The teacher is the
reference reading the sample's response after a hinted prompt.

Every forward returns one shape, `Forward`: the response tokens' log-probs (B, R), and on request
their entropy and the whole log-softmax. Knows models, samples and micro-batches, never the loss,
the optimizer or the engine.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass

import torch

from ocrl.loaded import LORA_TARGETS
from ocrl.train.batch import MicroBatch, teacher_view
from ocrl.train.budget import Budget
from ocrl.train.loss import entropy_from_logits, token_logprobs
from ocrl.train.reference_prefix import ReferencePrefix
from ocrl.types import Sample

ADAPTER = "default"  # peft's name for the one adapter we train


def train_device(model) -> torch.device:
    """The trainer works where the served model sits (the GPU on a GPU box, else the CPU)."""
    return next(model.parameters()).device


def trains_lora(config) -> bool:
    """Whether the trainer trains a LoRA adapter (else the whole model)."""
    return config.lora_rank > 0 and not config.full_finetune


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


@dataclass
class Forward:
    """A forward over a micro-batch's response tokens."""

    logprobs: torch.Tensor  # (B, R) log pi(a_t | s_t)
    entropy: torch.Tensor | None = None  # (B, R), when asked for
    every: torch.Tensor | None = None  # (B, R, V) the whole log-softmax, when asked for (top-K distillation)


@dataclass
class Teacher:
    """The teacher (the reference with hints in its prompt) on one sample's response tokens."""

    logprobs: torch.Tensor  # (R,) log pi_teacher(a_t | s + hint)
    top_ids: torch.Tensor | None = None  # (R, K) with --distill-topk K
    top_logprobs: torch.Tensor | None = None  # (R, K)


@dataclass
class TeacherRows:
    """The teacher laid out like a micro-batch."""

    logprobs: torch.Tensor  # (B, R)
    distilled: torch.Tensor  # (B,) which rows have a teacher
    top_ids: torch.Tensor  # (B, R, K) zeros without --distill-topk
    top_logprobs: torch.Tensor  # (B, R, K)


def _engine_name(module_name: str) -> str:
    """peft's module path -> the plain model's: drop the wrapper prefix and `.base_layer`."""
    return module_name.removeprefix("base_model.model.").replace(".base_layer", "")


class Policy:
    """The trained copy (`model`), the reference (`reference`, or the adapters-off model with
    LoRA) and their forwards. `publish_adapters`: `published_weights` hands over the LoRA
    adapter itself (to an engine that `accepts_adapters`), not merged weights."""

    def __init__(self, config, model, *, device: str | torch.device = "cpu", publish_adapters: bool = False):
        self.config = config
        self.device = torch.device(device)
        self.lora = trains_lora(config)
        self.publish_adapters = publish_adapters
        self.model, self.reference = self._build(model)
        mode = getattr(config, "gradient_checkpointing", "off")
        self._checkpointed_layers = self._enable_checkpointing() if mode != "off" else []
        # when a micro-batch's backward recomputes its layers, and whether a sample fits at all
        self.budget = Budget(mode, self.model.config, self.device, lora_rank=config.lora_rank if self.lora else 0, full_finetune=not self.lora,
                             model_bytes=4 * sum(p.numel() for p in self.model.parameters()))  # fmt: skip
        # the reference never changes: its KV for a session's earlier turn serves the next turn
        self.reference_prefix = ReferencePrefix(getattr(config, "prefix_cache", "0"), self.device)

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

    def _enable_checkpointing(self) -> list[torch.nn.Module]:
        """Lets the trained model recompute each decoder layer in the backward instead of keeping
        its activations (transformers' activation checkpointing, non-reentrant), switched per
        forward by `checkpoint=`; off until then. Returns the layers it can switch."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        inner = self.model.get_base_model() if self.lora else self.model
        # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias)
        enable = getattr(inner, "activation_checkpointing_enable", None) or inner.gradient_checkpointing_enable
        enable({"use_reentrant": False})
        # it also makes the embeddings' output require grad, which only the reentrant variant
        # needs (LoRA: no input of a checkpointed layer would otherwise require grad); the
        # non-reentrant one reaches the adapters' weights without it, and layer 0 then computes
        # no input gradient nobody reads
        inner.disable_input_require_grads()
        layers = [m for m in inner.modules() if isinstance(m, GradientCheckpointingLayer)]
        for layer in layers:
            layer.gradient_checkpointing = False
        return layers

    @contextlib.contextmanager
    def _checkpointing(self, on: bool):
        """Decoder layers recompute in the backward while `on`. transformers checkpoints a layer
        only in training mode: the layer's own flag is set, never its submodules' (no dropout)."""
        if not on:
            yield
            return
        if not self._checkpointed_layers:
            raise ValueError("gradient checkpointing was not enabled for this model (--gradient-checkpointing off)")
        for layer in self._checkpointed_layers:
            layer.gradient_checkpointing, layer.training = True, True
        try:
            yield
        finally:
            for layer in self._checkpointed_layers:
                layer.gradient_checkpointing, layer.training = False, False

    def _reference_mode(self):
        """The model to run for reference log-probs, and the context that makes it the base."""
        if self.lora:
            return self.model, self.model.disable_adapter()
        return self.reference, contextlib.nullcontext()

    def forward(self, model, batch: MicroBatch, *, entropy: bool = False, every: bool = False, checkpoint: bool = False) -> Forward:
        """`model` on `batch`'s response tokens; with `entropy` their entropy (with gradient only
        when --entropy-coef reads it), with `every` the whole log-softmax. `checkpoint`: the
        trained model's decoder layers keep only their inputs for the backward and run again in
        it (one more forward for ~1/20 of the activation memory; see budget.py)."""
        span = batch.targets.shape[1]
        with self._checkpointing(checkpoint):
            out = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=span + 1,
            )
        logits = out.logits[:, :-1]  # (B, R, V): position t predicts response token t
        if every:
            whole = torch.log_softmax(logits.float(), dim=-1)  # (B, R, V)
            result = Forward(whole.gather(-1, batch.targets.long().unsqueeze(-1)).squeeze(-1), every=whole)  # (B, R)
        else:
            result = Forward(token_logprobs(logits, batch.targets))  # (B, R)
        if entropy and self.config.entropy_coef:
            result.entropy = entropy_from_logits(logits)  # (B, R)
        elif entropy:
            with torch.no_grad():  # reported only: no graph for it
                result.entropy = entropy_from_logits(logits.detach())
        return result

    @torch.no_grad()
    def response_logprobs(self, samples: list[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        """Teacher-forced log-probs of each sample's response, one (R,) tensor per sample,
        under the trained policy or (reference=True) the reference. One sample at a time, so
        there is no padding and the numbers match the engine's `score`. The reference reuses its
        own work on a session's earlier turns (see reference_prefix.py)."""
        out = []
        for sample in samples:
            if not reference:
                out.append(self.forward(self.model, MicroBatch.of([sample], self.device)).logprobs[0].cpu())
                continue
            model, mode = self._reference_mode()
            with mode:
                if self.reference_prefix.enabled:
                    out.append(self.reference_prefix.logprobs(model, sample).cpu())
                else:
                    out.append(self.forward(model, MicroBatch.of([sample], self.device)).logprobs[0].cpu())
        return out

    @torch.no_grad()
    def teacher_logprobs(self, samples: list[Sample]) -> list[Teacher]:
        """The teacher on each distilled sample: the reference (adapters off, or the frozen copy)
        scoring the sample's response ids after its hinted prompt, one sample at a time; with
        --distill-topk K also its K most likely tokens at every response position."""
        k = self.config.distill_topk
        model, mode = self._reference_mode()
        out = []
        with mode:
            for sample in samples:
                forward = self.forward(model, MicroBatch.of([teacher_view(sample)], self.device), every=k > 0)
                if k > 0:
                    top = forward.every[0].topk(k, dim=-1)
                    out.append(Teacher(forward.logprobs[0].cpu(), top.indices.cpu(), top.values.cpu()))
                else:
                    out.append(Teacher(forward.logprobs[0].cpu()))
        return out

    def reference_rows(
        self, group: list[Sample], micro: MicroBatch, prefetched: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """Reference log-probs of `group` as (B, R), laid out like `micro`: the prefetched
        ones as they are, the others from one no-grad forward of just those samples (a sample
        alone, i.e. a long one, through the reference's prefix cache)."""
        missing = [s for s in group if id(s) not in prefetched]
        if len(missing) == 1 and self.reference_prefix.enabled:
            prefetched = prefetched | {id(missing[0]): self.response_logprobs(missing, reference=True)[0]}
        elif missing:
            # none prefetched (the common cold case): the group's own micro-batch serves as is
            missing_micro = micro if len(missing) == len(group) else MicroBatch.of(missing, self.device)
            model, mode = self._reference_mode()
            with torch.no_grad(), mode:
                computed = self.forward(model, missing_micro).logprobs  # (b, r)
            if missing_micro is micro:
                return computed
            width = computed.shape[1]
            prefetched = prefetched | {id(s): computed[row, width - s.response_length :] for row, s in enumerate(missing)}
        span = micro.targets.shape[1]
        rows = torch.zeros((len(group), span), dtype=torch.float32, device=self.device)  # (B, R)
        for row, sample in enumerate(group):
            rows[row, span - sample.response_length :] = prefetched[id(sample)].to(self.device)
        return rows

    def teacher_rows(self, group: list[Sample], micro: MicroBatch, prefetched: dict[int, Teacher]) -> TeacherRows:
        """The teacher laid out like `micro`, computed where not prefetched."""
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
        return TeacherRows(*(t.to(self.device) for t in (logprobs, distilled, top_ids, top_logprobs)))

    @torch.no_grad()
    def published_weights(self) -> dict[str, torch.Tensor]:
        """What the engine needs to serve the current policy, named as in the plain model.

        LoRA: only the adapted linear weights, merged (W + scale * B @ A) into new tensors; the
        training model is left as it is; with `publish_adapters` (`--weight-sync lora`), the
        adapter itself, named as peft saves it. Full fine-tuning: every parameter (views, not
        copies: the engine copies them while we hold the step lock).
        """
        if not self.lora:
            return {name: p.detach() for name, p in self.model.named_parameters()}
        if self.publish_adapters:
            from peft import get_peft_model_state_dict

            return {name: t.detach().clone() for name, t in get_peft_model_state_dict(self.model, adapter_name=ADAPTER).items()}
        from peft.tuners.lora import LoraLayer

        merged = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                weight = module.get_base_layer().weight.detach()
                merged[_engine_name(name) + ".weight"] = weight + module.get_delta_weight(ADAPTER).to(weight.dtype)
        return merged
