"""The training loop of a draft head: batches, AdamW, schedule, checkpoints, validation.

The target stays frozen: only its embedding table and lm_head are used, to embed the
shifted tokens and to turn features into distributions. The head keeps fp32 master
weights and runs under bf16 autocast. A checkpoint (head, optimizer, schedule, step)
is written every N steps and at the end; resuming replays the same data order and
skips the batches already done, so a resumed run sees the data an unbroken one would.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eagle2_core.draft import DraftHead
from eagle2_core.eagle3 import Eagle3Head
from eagle2_core.models import Target
from eagle2_core.train.data import FeatureSequence, sequence_lengths
from eagle2_core.train.loss import (
    CE_WEIGHT,
    NOISE_WIDTH,
    REGRESSION_WEIGHT,
    Batch,
    LossParts,
    batch_loss,
)
from eagle2_core.train.ttt import TTT_STEPS, ttt_loss

SCHEDULES = ("cosine", "constant")
BUCKET_BATCHES = 32  # batches per pool sorted by length (epoch_batches)
CHECKPOINT_NAME = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; defaults follow the EAGLE reference where it has one."""

    epochs: int = 1
    batch_size: int = 8
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 20
    schedule: str = "cosine"
    grad_clip: float = 0.5
    noise_width: float = NOISE_WIDTH
    regression_weight: float = REGRESSION_WEIGHT
    ce_weight: float = CE_WEIGHT
    ttt_steps: int = TTT_STEPS  # EAGLE-3 heads: draft steps unrolled per batch
    checkpoint_every: int = 100
    autocast: bool = True
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.epochs < 1 or self.batch_size < 1 or self.checkpoint_every < 1:
            raise ValueError("epochs, batch_size and checkpoint_every must be >= 1")


@dataclass
class Metrics:
    """Averages over scored positions (answer tokens)."""

    loss: float = 0.0
    regression: float = 0.0
    ce: float = 0.0
    top1: float = 0.0
    positions: int = 0
    top1_by_step: list[float] = field(default_factory=list)  # EAGLE-3: per draft step


@dataclass
class TrainResult:
    """What a run did: steps taken in total (resumed runs included) and what it reached."""

    steps: int
    tokens_seen: int  # answer positions scored, summed over steps
    train: Metrics  # over the last epoch trained in this call (noise on)
    validation: Metrics | None
    # per checkpoint: step, train loss / top1 since the last one, val_loss / val_top1
    history: list[dict] = field(default_factory=list)


def collate(sequences: Sequence[FeatureSequence]) -> Batch:
    """Right-pad conversations into one batch (pad id 0, zero features, mask False)."""
    length = max(len(s) for s in sequences)
    hidden = sequences[0].features.shape[-1]
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    features = torch.zeros(len(sequences), length, hidden, dtype=sequences[0].features.dtype)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    first_states = sequences[0].layer_states
    states = None
    if first_states is not None:
        states = first_states.new_zeros(len(sequences), length, first_states.shape[-1])
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = s.input_ids
        features[row, : len(s)] = s.features
        mask[row, : len(s)] = s.loss_mask
        if states is not None:
            states[row, : len(s)] = s.layer_states
    return Batch(ids, features, mask, states)


def epoch_batches(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Shuffled batches of indices, the same for the same (seed, epoch): resumable order.

    Conversations are shuffled, then each pool of BUCKET_BATCHES batches' worth is sorted
    by length and cut into batches, and the batches are shuffled: a batch pads to its
    longest member, so similar lengths waste far less (the head's attention is quadratic
    in it, EAGLE-3's training-time test materialises it per step) while every epoch still
    sees the data in a new random order."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    pool = batch_size * BUCKET_BATCHES
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lengths.__getitem__)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    shuffled = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in shuffled]


def lr_lambda(config: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up, then constant or cosine decay to zero at total_steps."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        span = max(1, total_steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - config.warmup_steps) / span)))

    return factor


def _autocast(config: TrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.autocast)


class _Running:
    """Position-weighted sums of the loss parts, turned into Metrics on demand."""

    def __init__(self) -> None:
        self.sums = {"loss": 0.0, "regression": 0.0, "ce": 0.0, "top1": 0.0}
        self.by_step: list[float] = []
        self.positions = 0

    def add(self, parts: LossParts) -> None:
        for key in self.sums:
            self.sums[key] += getattr(parts, key).item() * parts.positions
        for j, top1 in enumerate(parts.top1_by_step):  # weighted by step 0's positions
            if j == len(self.by_step):
                self.by_step.append(0.0)
            self.by_step[j] += top1 * parts.positions
        self.positions += parts.positions

    def metrics(self) -> Metrics:
        n = max(1, self.positions)
        return Metrics(
            **{k: v / n for k, v in self.sums.items()},
            positions=self.positions,
            top1_by_step=[v / n for v in self.by_step],
        )


def loss_head(
    target: Target, vocab_ids: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The frozen lm_head the loss scores through, over the draft vocabulary when there is
    one (the distributions drafting ranks, at a sixth of the cost for SmolLM2); gradients
    pass through to the head's output."""
    weight = target.lm_weight
    if vocab_ids is not None:
        weight = weight[vocab_ids.to(weight.device)]
    return lambda hidden: torch.nn.functional.linear(hidden, weight)


def head_loss(
    head: DraftHead | Eagle3Head,
    target: Target,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    batch: Batch,
    config: TrainConfig,
    noise_width: float,
    generator: torch.Generator | None = None,
) -> LossParts:
    """The head's objective: EAGLE's feature regression + CE, or EAGLE-3's unrolled CE."""
    if isinstance(head, Eagle3Head):
        return ttt_loss(head, target.embed, lm_head, batch, config.ttt_steps)
    return batch_loss(
        head,
        target.embed,
        lm_head,
        batch,
        noise_width,
        generator,
        config.regression_weight,
        config.ce_weight,
    )


@torch.inference_mode()
def evaluate(
    head: DraftHead,
    target: Target,
    sequences: Sequence[FeatureSequence],
    config: TrainConfig,
    vocab_ids: torch.Tensor | None = None,
) -> Metrics:
    """Loss and top-1 on held-out conversations, without input noise (as when drafting)."""
    device = torch.device(config.device)
    was_training = head.training
    head.eval()
    lm_head = loss_head(target, vocab_ids)
    running = _Running()
    for start in range(0, len(sequences), config.batch_size):
        batch = collate(sequences[start : start + config.batch_size]).to(device)
        with _autocast(config, device):
            parts = head_loss(head, target, lm_head, batch, config, noise_width=0.0)
        running.add(parts)
    head.train(was_training)
    return running.metrics()


def save_checkpoint(path: Path, state: dict) -> None:
    """Write via a temporary file, so a crash mid-write leaves the previous checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(
    head: DraftHead,
    target: Target,
    train_data: Sequence[FeatureSequence],
    config: TrainConfig,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    validation_data: Sequence[FeatureSequence] = (),
    progress: bool = True,
    vocab_ids: torch.Tensor | None = None,
    on_step: Callable[[int, int, DraftHead], object] | None = None,
) -> TrainResult:
    """Train `head` in place on `train_data` for config.epochs; returns what it reached.

    With resume and a checkpoint in checkpoint_dir, continues from its step. vocab_ids:
    the draft vocabulary the loss scores over (None: the target's whole vocabulary);
    on_step(step, tokens_seen, head) after every step.
    """
    if not train_data:
        raise ValueError("no training conversations: nothing to learn from")
    device = torch.device(config.device)
    head.to(device=device, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    steps_per_epoch = math.ceil(len(train_data) / config.batch_size)
    total_steps = steps_per_epoch * config.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, total_steps))
    step, tokens_seen, history = 0, 0, []
    checkpoint = Path(checkpoint_dir) / CHECKPOINT_NAME if checkpoint_dir is not None else None
    if resume and checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, tokens_seen, history = state["step"], state["tokens_seen"], state["history"]

    def write_checkpoint() -> None:
        if checkpoint is not None:
            save_checkpoint(
                checkpoint,
                {
                    "head": head.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "tokens_seen": tokens_seen,
                    "history": history,
                    "config": asdict(config),
                },
            )

    generator = torch.Generator(device=device).manual_seed(config.seed + step)
    lm_head = loss_head(target, vocab_ids)
    window, epoch_window = _Running(), _Running()  # since the last checkpoint / epoch start
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not progress)
    lengths = sequence_lengths(train_data)
    for batch_indices in _remaining_batches(lengths, config, step, steps_per_epoch):
        batch = collate([train_data[i] for i in batch_indices]).to(device)
        with _autocast(config, device):
            parts = head_loss(head, target, lm_head, batch, config, config.noise_width, generator)
        optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        tokens_seen += parts.positions
        if (step - 1) % steps_per_epoch == 0:
            epoch_window = _Running()
        window.add(parts)
        epoch_window.add(parts)
        bar.update()
        bar.set_postfix(loss=f"{parts.loss.item():.3f}", acc=f"{parts.top1.item():.3f}")
        if on_step is not None:
            on_step(step, tokens_seen, head)
        if step % config.checkpoint_every == 0 or step == total_steps:
            seen = window.metrics()
            history.append({"step": step, "loss": seen.loss, "top1": seen.top1})
            if validation_data:
                held_out = evaluate(head, target, validation_data, config, vocab_ids)
                history[-1].update(val_loss=held_out.loss, val_top1=held_out.top1)
                if held_out.top1_by_step:
                    history[-1].update(val_top1_by_step=held_out.top1_by_step)
            window = _Running()
            write_checkpoint()
    bar.close()
    validation = (
        evaluate(head, target, validation_data, config, vocab_ids) if validation_data else None
    )
    return TrainResult(step, tokens_seen, epoch_window.metrics(), validation, history)


def _remaining_batches(
    lengths: Sequence[int], config: TrainConfig, done: int, steps_per_epoch: int
) -> Iterator[list[int]]:
    """The batches left after `done` steps, in the order an unbroken run takes them."""
    for epoch in range(done // steps_per_epoch, config.epochs):
        batches = epoch_batches(lengths, config.batch_size, config.seed, epoch)
        skip = done - epoch * steps_per_epoch if epoch == done // steps_per_epoch else 0
        yield from batches[skip:]
