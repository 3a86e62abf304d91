"""Did the replay predict a served A/B? `benchmarks.replay_split` replays a served run with a setting it did not
run (e.g. `--prefill-order max_on_time` on a least_slack run); when a system with that setting was served on the
same draw (the same runs/ folder: one workload and seed; one call or several of one lease), the two can be laid
side by side. For every served run replayed with every setting, this prints and draws:

- replayed against measured attainment (under the SLO the replays were scored by: replay_split's `--slo` /
  `--score-slo`), where "measured" is the served run of the system that ran the replayed setting (the run's own
  setting: the replay against its own run; the other setting: against the other system's run, the prediction);
- the change the replay predicted (the other setting against the run's own, both replayed from one run) against
  the change measured (the other system's served run against this one).

    python -m benchmarks.replay_vs_served benchmarks/results/replay_vs_served_m8 \\
        --systems least_slack=bullet-slo-margin50-pl10+lt+direct,max_on_time=bullet-slo-margin50-pl10-mot+lt+direct \\
        --out benchmarks/results/replay_vs_served_m8/replay_vs_served.png

Every served system named in --systems must have been replayed at the rates compared (its replay_split JSON carries
its measured attainment); a missing one is named. A model checked against measurements, not a measurement.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.plot_replays import Replay, folder_parser, load

# a change smaller than this (half a point of attainment: less than one request of 150) has no sign
SIGN_TOLERANCE = 0.005


def parse_systems(text: str) -> dict[str, str]:
    """"setting=system,..." -> {setting: served system}."""
    systems: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        setting, sep, system = part.partition("=")
        if not sep or not setting or not system:
            raise SystemExit(f"--systems: {part!r} is not setting=system")
        if setting in systems:
            raise SystemExit(f"--systems: {setting!r} named twice")
        if system in systems.values():
            raise SystemExit(f"--systems: {system!r} named for two settings; each setting needs the system that ran it")
        systems[setting] = system
    if len(systems) < 2:
        raise SystemExit("--systems: name at least two settings, each with the served system that ran it")
    return systems


@dataclass(frozen=True)
class Pair:
    """A replayed setting beside the served run that had it, and the change from the replayed run's own."""

    draw: str
    rate: float
    source: str  # the setting of the replayed run
    setting: str  # the replayed setting
    replayed: float
    low: float
    high: float
    measured: float  # the served attainment of the system that ran `setting`, same draw and rate
    slo: str
    predicted_change: float  # replayed(setting) - replayed(source's own setting), both from the source's run
    measured_change: float  # measured(setting's system) - measured(source's system)


def pair_up(replays: list[Replay], systems: dict[str, str]) -> list[Pair]:
    setting_of = {system: setting for setting, system in systems.items()}
    measured = {(r.draw, r.system, r.rate): r.measured for r in replays}
    replayed = {(r.draw, r.system, r.rate, r.setting): r for r in replays}
    pairs = []
    for r in replays:
        source = setting_of.get(r.system)
        if source is None or r.setting not in systems:
            continue  # a run or a setting outside the A/B
        own = replayed.get((r.draw, r.system, r.rate, source))
        target = measured.get((r.draw, systems[r.setting], r.rate))
        if own is None:
            raise SystemExit(f"{r.draw} {r.system} at {r.rate:g} req/s: no replay with its own setting {source!r}")
        if target is None:
            raise SystemExit(f"{r.draw} at {r.rate:g} req/s: no replay of {systems[r.setting]}'s run (its measured "
                             f"attainment comes from one)")
        pairs.append(Pair(r.draw, r.rate, source, r.setting, r.replayed, r.low, r.high, target, r.slo,
                          r.replayed - own.replayed, target - r.measured))
    if not pairs:
        raise SystemExit(f"no replayed run of {', '.join(systems.values())} with those settings")
    return sorted(pairs, key=lambda p: (p.draw, p.source, p.rate, p.setting))


def report(pairs: list[Pair]) -> str:
    slo = pairs[0].slo
    lines = [f"{slo} SLO attainment, replayed by a model and measured:", "",
             "| served draw | rate (req/s) | replayed run's setting | replayed setting | replayed [min, max] | "
             "measured | change predicted | change measured |", "|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        change = ("-", "-") if p.setting == p.source else \
            (f"{100 * p.predicted_change:+.1f}", f"{100 * p.measured_change:+.1f}")
        lines.append(f"| {p.draw} | {p.rate:g} | {p.source} | {p.setting} | {p.replayed:.1%} [{p.low:.1%}, "
                     f"{p.high:.1%}] | {p.measured:.1%} | {change[0]} | {change[1]} |")
    own = [p for p in pairs if p.setting == p.source]
    cross = [p for p in pairs if p.setting != p.source]
    lines.append("")
    for name, group in (("its own setting", own), ("the other setting", cross)):
        if group:
            errors = [abs(p.replayed - p.measured) for p in group]
            inside = sum(p.low <= p.measured <= p.high for p in group)
            lines.append(f"replayed with {name}: {len(group)} runs, |replayed - measured| median "
                         f"{100 * statistics.median(errors):.1f} points, max {100 * max(errors):.1f}; measured inside "
                         f"the replay's [min, max] over seeds: {inside} of {len(group)}")
    # each direction on its own: the served difference of a (draw, rate) is one measurement, predicted once from
    # each of its two runs
    for source, setting in sorted({(p.source, p.setting) for p in cross}):
        group = [p for p in cross if (p.source, p.setting) == (source, setting)]
        signed = [p for p in group if abs(p.predicted_change) >= SIGN_TOLERANCE
                  and abs(p.measured_change) >= SIGN_TOLERANCE]
        right = sum((p.predicted_change > 0) == (p.measured_change > 0) for p in signed)
        lines.append(f"{source} -> {setting} ({len(group)} served differences, each predicted from the {source} "
                     f"run): the predicted change has the measured one's sign in {right} of {len(signed)} (changes "
                     f"under {100 * SIGN_TOLERANCE:g} points have none); mean change predicted "
                     f"{100 * statistics.fmean(p.predicted_change for p in group):+.1f}, measured "
                     f"{100 * statistics.fmean(p.measured_change for p in group):+.1f} points")
    return "\n".join(lines)


def plot(pairs: list[Pair], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6))
    settings = sorted({p.setting for p in pairs})
    colors = {s: f"C{i}" for i, s in enumerate(settings)}
    for p in pairs:
        own = p.setting == p.source
        left.errorbar(100 * p.replayed, 100 * p.measured, xerr=[[100 * (p.replayed - p.low)], [100 * (p.high - p.replayed)]],
                      fmt="o" if own else "^", color=colors[p.setting], mfc="none" if own else colors[p.setting],
                      alpha=0.8, elinewidth=0.6)
        if not own:
            right.scatter(100 * p.predicted_change, 100 * p.measured_change, color=colors[p.setting], marker="^")
            right.annotate(f"{p.draw.split('/')[-1]} {p.rate:g}", (100 * p.predicted_change, 100 * p.measured_change),
                           fontsize=6, xytext=(3, 2), textcoords="offset points")
    lo = min(min(p.low, p.measured) for p in pairs) * 100 - 2
    left.plot([lo, 100], [lo, 100], color="grey", linewidth=0.8, linestyle=":")
    left.set_xlabel(f"replayed {pairs[0].slo} SLO attainment (%), mean and [min, max] over noise seeds")
    left.set_ylabel("measured (%): served with the replayed setting")
    for s in settings:
        left.plot([], [], "^", color=colors[s], label=f"{s}, replayed from the other setting's run (prediction)")
        left.plot([], [], "o", color=colors[s], mfc="none", label=f"{s}, replayed from its own run")
    left.legend(fontsize=7, loc="lower right")
    left.grid(alpha=0.3)
    span = max([abs(100 * v) for p in pairs if p.setting != p.source
                for v in (p.predicted_change, p.measured_change)] + [1.0]) * 1.1
    right.plot([-span, span], [-span, span], color="grey", linewidth=0.8, linestyle=":")
    right.axhline(0, color="black", linewidth=0.5)
    right.axvline(0, color="black", linewidth=0.5)
    right.set_xlim(-span, span)
    right.set_ylim(-span, span)
    right.set_xlabel("change predicted by the replay (points)")
    right.set_ylabel("change measured, same draw (points)")
    right.set_title("the other setting against the run's own", fontsize=9)
    right.grid(alpha=0.3)
    fig.suptitle("benchmarks/replay_split (a model) against the served A/B; dotted: replayed = measured", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = folder_parser(__doc__)
    parser.add_argument("--systems", required=True,
                        help="setting=served system, comma-separated: which served system ran each replayed setting "
                             "(e.g. least_slack=bullet-slo-margin50-pl10+lt+direct,max_on_time=...-mot+lt+direct)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        raise SystemExit(f"folder: {args.folder} is not a folder")
    pairs = pair_up(load(args.folder, args.label_by), parse_systems(args.systems))
    print(report(pairs))
    if args.out is not None:
        plot(pairs, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
