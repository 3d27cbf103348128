"""`eagle2-batch stats`: what a job produced and why it was fast (acceptance statistics).

The numbers come from one pass over the stored rows (`compute_stats`, a pure function,
so tests recompute them independently); `format_stats` writes them as a table and
`plot_stats` draws them with matplotlib (the command: producer/cli/stats.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle2_core.registry import draft_label

GROUP_COLUMNS = ("category", "shard", "finish_reason", "head_version")
# The fields stats reads: everything but the (large) output text.
STATS_COLUMNS = (
    *GROUP_COLUMNS,
    "request_id",
    "status",
    "completion_tokens",
    "mean_accept_length",
    "mean_tree_size",
    "accept_hist",
    "depth_attempts",
    "depth_accepts",
    "total_ms",
    "tokens_per_s",
)
NO_GROUP = "(none)"


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _add_into(total: list[int], values: Iterable[int] | None) -> None:
    for i, v in enumerate(values or ()):
        if i == len(total):
            total.append(0)
        total[i] += v


@dataclass
class Accumulator:
    """Running sums over a group of rows; `summary()` turns them into the reported numbers.

    Throughput, tau and acceptance count ok samples only: a failed sample measured nothing.
    Samples are completions; `requests` counts the input lines they answer, from rows in
    line order (a line's completions are adjacent, in every group too), so no set of ids
    grows with the job.
    """

    samples: int = 0
    requests: int = 0
    last_request: str | None = None
    ok: int = 0
    failed: int = 0
    completion_tokens: int = 0
    timed_tokens: int = 0
    total_ms: float = 0.0
    taus: list[float] = field(default_factory=list)
    tree_sizes: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    accept_hist: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)

    def add(self, row: Mapping[str, Any]) -> None:
        """Count one output row."""
        self.samples += 1
        if row["request_id"] != self.last_request:
            self.requests += 1
            self.last_request = row["request_id"]
        if row["status"] != "ok":
            self.failed += 1
            return
        self.ok += 1
        tokens = row["completion_tokens"] or 0
        self.completion_tokens += tokens
        if row["total_ms"]:
            self.timed_tokens += tokens
            self.total_ms += row["total_ms"]
        if row["mean_accept_length"] is not None:
            self.taus.append(row["mean_accept_length"])
        if row.get("mean_tree_size") is not None:
            self.tree_sizes.append(row["mean_tree_size"])
        if row["tokens_per_s"] is not None:
            self.rates.append(row["tokens_per_s"])
        _add_into(self.accept_hist, row["accept_hist"])
        _add_into(self.depth_attempts, row["depth_attempts"])
        _add_into(self.depth_accepts, row["depth_accepts"])

    def summary(self) -> dict[str, Any]:
        """The reported numbers (JSON-ready)."""
        return {
            "samples": self.samples,
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.failed,
            "completion_tokens": self.completion_tokens,
            "tau_mean": sum(self.taus) / len(self.taus) if self.taus else None,
            "tau_p50": percentile(self.taus, 0.5),
            "tau_p90": percentile(self.taus, 0.9),
            "tree_size_mean": (
                sum(self.tree_sizes) / len(self.tree_sizes) if self.tree_sizes else None
            ),
            # Aggregate throughput: all tokens over all decode time.
            "tokens_per_s": self.timed_tokens / self.total_ms * 1000 if self.total_ms else None,
            "tokens_per_s_mean": sum(self.rates) / len(self.rates) if self.rates else None,
            "accept_hist": list(self.accept_hist),
            "depth_attempts": list(self.depth_attempts),
            "depth_accepts": list(self.depth_accepts),
            "depth_accept_rate": [
                acc / att if att else None
                for att, acc in zip(self.depth_attempts, self.depth_accepts, strict=False)
            ],
        }


def accumulate(
    rows: Iterable[Mapping[str, Any]], by: str | None = None
) -> tuple[Accumulator, dict[str, Accumulator]]:
    """One pass over output rows: the overall accumulator and one per value of `by`."""
    overall = Accumulator()
    groups: dict[Any, Accumulator] = {}
    for row in rows:
        overall.add(row)
        if by is not None:
            groups.setdefault(row[by], Accumulator()).add(row)
    ordered = sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    return overall, {NO_GROUP if k is None else str(k): acc for k, acc in ordered}


def compute_stats(rows: Iterable[Mapping[str, Any]], by: str | None = None) -> dict[str, Any]:
    """Job statistics from output rows: {'overall': {...}, 'groups': {value: {...}}}.

    `rows` come in line order (`iter_samples`). Each entry: samples (completions),
    requests (the input lines they answer), ok, failed, completion_tokens,
    tau_mean/p50/p90 (per-sample mean accept length), tree_size_mean (mean of the
    samples' mean verified tree size), tokens_per_s (sum of tokens / sum of total_ms),
    tokens_per_s_mean (mean of per-sample rates), accept_hist (summed; index k = verify
    cycles that accepted k drafted tokens), depth_attempts/depth_accepts (summed) and
    depth_accept_rate (accepts / attempts per depth 1..D).
    """
    return summarize(*accumulate(rows, by))


def summarize(overall: Accumulator, groups: Mapping[str, Accumulator]) -> dict[str, Any]:
    """The `compute_stats` result from accumulators."""
    return {
        "overall": overall.summary(),
        "groups": {name: acc.summary() for name, acc in groups.items()},
    }


# --------------------------------------------------------------------------- output


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_stats(job: Mapping[str, Any], stats: Mapping[str, Any], by: str | None) -> str:
    """The human-readable report: a table per group, the histogram, rates by depth."""
    overall = stats["overall"]
    lines = [
        f"job {job['id']}  state={job['state']}  model={job['model']}  "
        f"draft={job_draft(job) or '-'}  mode={job['mode']}",
        f"expected {job['n_expected']}  stored {overall['samples']}"
        + (
            f" (completions of {overall['requests']} requests)"
            if overall["requests"] != overall["samples"]
            else ""
        )
        + f"  rejected lines {job['n_rejected']}",
        "",
    ]
    header = (
        by or "",
        "samples",
        "ok",
        "failed",
        "tokens",
        "tau",
        "p50",
        "p90",
        "tree",
        "tok/s",
        "per-sample",
    )
    rows = [("all", overall)] + [(name, s) for name, s in stats["groups"].items()]
    table = [header] + [
        (
            name,
            str(s["samples"]),
            str(s["ok"]),
            str(s["failed"]),
            str(s["completion_tokens"]),
            _fmt(s["tau_mean"]),
            _fmt(s["tau_p50"]),
            _fmt(s["tau_p90"]),
            _fmt(s["tree_size_mean"], 1),
            _fmt(s["tokens_per_s"], 1),
            _fmt(s["tokens_per_s_mean"], 1),
        )
        for name, s in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append(
            "  ".join(
                [r[0].ljust(widths[0])]
                + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
            )
        )
    lines.append(
        "tau: the samples' mean accept length (mean, p50, p90 over samples)\n"
        "tree: nodes verified per cycle (the samples' mean; auto sizing chooses it)\n"
        "tok/s: all tokens / all decode time; per-sample: mean of the samples' tok/s"
    )
    hist = overall["accept_hist"]
    cycles = sum(hist)
    if cycles:
        lines += ["", "verify cycles by drafted tokens accepted:"]
        for k, n in enumerate(hist):
            share = n / cycles
            lines.append(f"  {k:>2}  {n:>9}  {share:6.1%}  {'#' * round(share * 40)}")
    rates = overall["depth_accept_rate"]
    if rates:
        lines += ["", "acceptance rate by tree depth (accepted / attempted):"]
        for depth, (att, acc, rate) in enumerate(
            zip(overall["depth_attempts"], overall["depth_accepts"], rates, strict=True), 1
        ):
            lines.append(f"  {depth:>2}  {acc:>9} / {att:<9}  {_fmt(rate, 3)}")
    return "\n".join(lines)


def format_head_versions(attempts: list[Mapping[str, Any]]) -> str:
    """--adapt-draft's rounds: each version's data, tau before and after, and outcome."""
    if not attempts:
        return "draft head versions (--adapt-draft): none yet; samples so far use version 0"
    table = [("version", "from", "completions", "tau before", "tau after", "prompts", "train s")]
    table += [
        (
            str(a["version"]),
            str(a["based_on"]),
            str(a["train_completions"]),
            _fmt(a["tau_before"]),
            _fmt(a["tau_after"]),
            str(a["eval_prompts"]),
            f"{a['train_s']:.0f}",
        )
        for a in attempts
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["draft head versions (--adapt-draft; tau on held-out prompts of the job):"]
    for row, attempt in zip(table, [None, *attempts], strict=True):
        verdict = "" if attempt is None else ("published" if attempt["published"] else "kept old")
        cells = [c.rjust(w) for c, w in zip(row, widths, strict=True)]
        lines.append("  " + "  ".join(cells) + ("  " + verdict if verdict else ""))
    return "\n".join(lines)


def job_draft(job: Mapping[str, Any]) -> str | None:
    """The job's head as its rows name it (`shipped:MODEL` for the package's head)."""
    return draft_label(job["model"], job["draft"], job["mode"])


def plot_title(job: Mapping[str, Any]) -> str:
    return (
        f"eagle2-batch job {job['id'][:12]}: {job['model']} + "
        f"{job_draft(job) or 'no draft'} ({job['mode']})"
    )


def plot_stats(
    path: Path, title: str, overall: Accumulator, groups: Mapping[str, Accumulator], by: str
) -> None:
    """PNG with the accepted-length histogram, acceptance by depth and tau by group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hist, ax_depth, ax_tau) = plt.subplots(
        1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [1, 1, 1.3]}
    )
    fig.suptitle(title, fontsize=13)

    hist = overall.accept_hist
    cycles = sum(hist) or 1
    bars = ax_hist.bar(range(len(hist)), [100 * n / cycles for n in hist], color="#4C72B0")
    ax_hist.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ax_hist.grid(axis="y", alpha=0.3)
    ax_hist.set_xticks(range(len(hist)))
    ax_hist.set_xlabel("drafted tokens accepted in a verify cycle")
    ax_hist.set_ylabel("share of verify cycles (%)")
    tau = overall.summary()["tau_mean"]
    ax_hist.set_title(f"Accepted length ({sum(hist)} cycles, mean tau {_fmt(tau)})")

    rates = overall.summary()["depth_accept_rate"]
    depths = [d for d, r in enumerate(rates, 1) if r is not None]
    ax_depth.plot(depths, [100 * r for r in rates if r is not None], "o-", color="#DD8452")
    ax_depth.set_xticks(depths)
    ax_depth.set_ylim(0, 100)
    ax_depth.set_xlabel("tree depth")
    ax_depth.set_ylabel("accepted / attempted (%)")
    ax_depth.set_title("Acceptance rate by depth")
    ax_depth.grid(alpha=0.3)

    named = [(name, acc.taus) for name, acc in groups.items() if acc.taus]
    if named:
        ax_tau.boxplot([t for _, t in named], showmeans=True)
        crowded = len(named) > 5
        ax_tau.set_xticks(
            range(1, len(named) + 1),
            [f"{n}\n(n={len(t)})" for n, t in named],
            fontsize=9,
            rotation=30 if crowded else 0,
            ha="right" if crowded else "center",
        )
    ax_tau.set_xlabel(by)
    ax_tau.set_ylabel("mean accepted length per sample (tau)")
    ax_tau.set_title(f"tau by {by} (box: quartiles, triangle: mean)")
    ax_tau.grid(axis="y", alpha=0.3)

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_adaptation(path: Path, title: str, points: list[tuple[Any, float, int]]) -> None:
    """PNG of tau over an adapting job's completions, in the order they were stored
    ((stored at, tau, head version) per ok sample): a moving mean over 2% of the job,
    with a dashed line where a new head version starts drafting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: p[0])
    taus = [tau for _, tau, _ in points]
    window = max(1, len(taus) // 50)
    sums = [0.0]
    for tau in taus:
        sums.append(sums[-1] + tau)
    moving = [
        (sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(taus))
    ]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(range(1, len(taus) + 1), moving, color="#4C72B0", label=f"tau, mean of {window}")
    for i in range(1, len(points)):
        if points[i][2] != points[i - 1][2]:
            ax.axvline(i + 0.5, color="#C44E52", linestyle="--")
            ax.annotate(f"v{points[i][2]}", (i + 0.5, max(moving)), color="#C44E52", ha="left")
    ax.set_xlabel("completions, in the order they were stored")
    ax.set_ylabel("mean accepted length (tau)")
    ax.set_title(f"{title}: tau while the job adapts its draft head")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
