"""The README.md written beside a head that `train-draft` made: how it was made (data,
training settings) and what it reaches (held-out loss and top-1, tau)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch: imported where used, so other commands start fast
    from eagle2_core.train.loop import TrainConfig


def format_tau(tau: float | None) -> str:
    """tau as the card and train-draft's last line show it."""
    return f"{tau:.2f}" if tau is not None else "not measured"


def _sources(summary: dict[str, Any]) -> str:
    parts = []
    if summary["prompts"]:
        parts.append(
            f"answers written by the target itself to prompts from `{summary['prompts']}` "
            f"(temperature {summary['temperature']}, at most {summary['max_new_tokens']} "
            "new tokens)"
        )
    for name in summary["conversations"]:
        parts.append(f"the answer turns of `{name}`")
    return " and ".join(parts)


def _vocab_line(size: int | None, eagle3: bool) -> str:
    if size is None:
        return "the target's full vocabulary"
    where = "d2t / t2d in model.safetensors" if eagle3 else "draft_vocab.safetensors"
    return f"the {size} tokens most frequent in the training answers ({where})"


def model_card(summary: dict[str, Any], config: TrainConfig) -> str:
    """A short README.md for the head: how it was made and what it reaches."""
    from eagle2_core.train.loop import Metrics

    val = summary["validation"] or asdict(Metrics())
    tau = summary["tau"]
    noise = config.noise_width / 2
    eagle3 = summary.get("arch") == "eagle3"
    objective = (
        [
            "Trained with `eagle2-batch train-draft --arch eagle3`: EAGLE-3's training-time",
            f"test ({config.ttt_steps} draft steps unrolled, each step's soft cross-entropy",
            "to the target's distribution over the draft vocabulary, weighted 0.8^step).",
        ]
        if eagle3
        else [
            "Trained with `eagle2-batch train-draft`: the EAGLE objective (SmoothL1 on the",
            "next feature + 0.1 x soft cross-entropy through the frozen lm_head).",
        ]
    )
    by_step = ", ".join(f"{t:.1%}" for t in val.get("top1_by_step") or [])
    lines = [
        f"# EAGLE{'-3' if eagle3 else ''} draft head for `{summary['model']}`",
        "",
        *objective,
        "",
        f"- data: {summary['train_conversations']} conversations, "
        f"{summary['train_answer_tokens']} answer tokens: {_sources(summary)}; the "
        "validation split (sha256(id) % 50 == 0) held out",
        f"- training: {summary['steps']} steps, {config.epochs} epochs of batch "
        f"{config.batch_size}; AdamW lr {config.lr:g}, betas {config.betas}, "
        f"{config.warmup_steps} warm-up steps then {config.schedule}; gradient clip "
        f"{config.grad_clip}; "
        + ("" if eagle3 else f"input noise U(-{noise:g}, {noise:g}); ")
        + f"{'bf16 autocast' if config.autocast else 'fp32'} on {config.device}",
        f"- tokens seen: {summary['tokens_seen']}"
        + (f", starting from the head `{summary['init_head']}`" if summary["init_head"] else ""),
        f"- validation: {summary['validation_conversations']} held-out conversations, "
        f"{val['positions']} positions: loss {val['loss']:.4f}, top-1 agreement with the "
        f"target {val['top1']:.1%}" + (f" (by draft step: {by_step})" if by_step else ""),
        f"- draft vocabulary: {_vocab_line(summary['draft_vocab'], eagle3)}",
        f"- tau (EAGLE-2, T=0, the reference's 60-node tree; {summary['tau_source']}): "
        f"{format_tau(tau)}",
        "",
        *(
            [
                "Format: the public EAGLE-3 layout (config.json with LlamaForCausalLMEagle3 +",
                "model.safetensors, bf16); the target's embedding table is used, not stored.",
            ]
            if eagle3
            else [
                "Format: the public EAGLE checkpoint layout (config.json + model.safetensors,",
                "bf16); the target's embedding table and lm_head are used, not stored;",
                "draft_vocab.safetensors holds the draft vocabulary in EAGLE-3's d2t/t2d format.",
            ]
        ),
    ]
    return "\n".join(lines) + "\n"
