"""``python -m benchmarks.report DIR``: BENCHMARKS.md from the JSON files of ``make bench``.

``make bench`` runs the harness once per collective and rank count and writes
``DIR/<collective>-np<N>[-<kind>].json`` (and a PNG next to each). This module turns
them into markdown, one section per setup (rank count and whether idle ranks
busy-poll or yield, as each file records it; busy-polling first, the headline): a
table of the performance targets with the worst measured ratio and whether it was
met, then per run the exact command and a table of the median time of every
implementation per size with the ratios against the baselines (``mpi/x`` above 1:
``x`` is faster than native MPI). The prose around the tables comes from a template
whose ``{{results}}`` line is replaced; its ``{{train}}`` line gets the tables of the
training benchmark's ``DIR/train-np<N>[-fp16].json`` (:mod:`benchmarks.train`), its
``{{multinode}}`` line those of ``benchmarks/multinode.sh``'s runs in ``DIR/multinode``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KiB, MiB = 1 << 10, 1 << 20
Row = dict[str, Any]
Setup = tuple[bool, int]
"""(ranks yield, rank count): a section of the report."""
GLOO_OF = {"mpitrain": "ddp", "ddp": "ddp", "ddp-mpitrain": "ddp", "fsdp": "fsdp",
           "fsdp-mpitrain": "fsdp"}
"""Per implementation of the training benchmark, the gloo one its ``gloo/impl`` ratio
is taken against: DDP for the data-parallel rows, FSDP for the sharded ones."""
ALONE, NO_COMM = "1 rank", "no comm"
"""The training benchmark's two rows without communication: one rank training alone
(the scaling baseline), and every rank training its own copy at once (the step of an
implementation whose communication cost nothing)."""
BASELINES = (ALONE, NO_COMM)


@dataclass(frozen=True)
class Run:
    """One harness run: its file's kind (``""``, ``inplace``, ``malloc``, ``overhead``)."""

    collective: str
    ranks: int
    kind: str
    path: str
    doc: dict[str, Any]

    @property
    def labels(self) -> list[str]:
        """Implementation labels in column order."""
        return list(self.doc["settings"]["impls"])

    def result(self, size: int, impl: str, inplace: bool = False) -> Row | None:
        """The result of ``impl`` at ``size`` (``None`` if it did not run)."""
        for r in self.doc["results"]:
            if r["size"] == size and r["impl"] == impl and r["inplace"] == inplace:
                return r  # type: ignore[no-any-return]
        return None

    def sizes(self) -> list[int]:
        """Every size measured, ascending."""
        return sorted({r["size"] for r in self.doc["results"]})

    @property
    def idle_wait(self) -> str:
        """``busy-poll`` or ``yield``, as the run recorded it (files written before it
        was recorded came from ``make bench`` runs that all yielded)."""
        return str(self.doc["machine"].get("idle_wait", "yield"))

    @property
    def setup(self) -> Setup:
        """The section this run belongs to: busy-polling first, then by rank count."""
        return (self.idle_wait != "busy-poll", self.ranks)


def setup_title(run: Run) -> str:
    """The heading of ``run``'s setup: ``2 ranks on 2 cores, busy-polling``."""
    cpus = run.doc["machine"].get("cpus")
    where = f" on {cpus} cores" if cpus else ""
    if run.idle_wait == "busy-poll":
        return f"{run.ranks} ranks{where}, busy-polling (plain `mpirun -np {run.ranks}`)"
    return f"{run.ranks} ranks{where}, yielding (`--mca mpi_yield_when_idle 1`)"


def load(folder: str, case: str | None = None) -> list[Run]:
    """Every ``<collective>-np<N>[-<kind>].json`` of ``folder`` whose ``case`` is
    ``case`` (``None``: the harness's runs, which name no case; ``"train"``: the
    training benchmark's)."""
    runs = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        stem = os.path.basename(path)[:-5]
        parts = stem.split("-")
        if len(parts) < 2 or not parts[1].startswith("np"):
            continue
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("case") == case:
            runs.append(Run(parts[0], int(parts[1][2:]), "-".join(parts[2:]), path, doc))
    return runs


def human_size(nbytes: int) -> str:
    """``4 B``, ``16 KiB``, ``256 MiB``."""
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit:
            return f"{nbytes / unit:g} {name}"
    return f"{nbytes} B"


def human_time(us: float) -> str:
    """Microseconds under 10 ms, else milliseconds."""
    return f"{us:.1f} us" if us < 10_000 else f"{us / 1000:.1f} ms"


def _short(label: str) -> str:
    """mpitrain's columns by their algorithm (``auto``, ``ring``, ...); others as they are."""
    if not label.startswith("mpitrain"):
        return label
    return label.replace("mpitrain:", "").replace("mpitrain", "auto")


def _ours(run: Run) -> str:
    """The label of mpitrain's automatic choice in ``run``."""
    return "mpitrain:auto" if "mpitrain:auto" in run.labels else "mpitrain"


def table(run: Run, inplace: bool = False) -> list[str]:
    """Times of every implementation per size, baseline ratios, and bus bandwidths."""
    ours = _ours(run)
    labels = run.labels
    baselines = [b for b in ("mpi", "gloo") if b in labels]
    head = ["size", *[_short(label) for label in labels],
            *[f"{b}/auto" for b in baselines], "busbw auto", "busbw mpi", "peak+ auto",
            "peak+ mpi"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in run.sizes():
        cells = [human_size(size)]
        mine = run.result(size, ours, inplace)
        for label in labels:
            r = run.result(size, label, inplace)
            cells.append(human_time(r["time_us"]) if r else "N/A")
        for b in baselines:
            r = run.result(size, b, inplace)
            cells.append(f"{r['time_us'] / mine['time_us']:.2f}" if r and mine else "N/A")
        native = run.result(size, "mpi", inplace)
        for r in (mine, native):
            cells.append(f"{r['busbw']:.2f}" if r else "N/A")
        for r in (mine, native):
            cells.append(f"{r['extra_mib']:.1f} MiB" if r and r.get("extra_mib", -1) >= 0
                         else "N/A")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


@dataclass(frozen=True)
class Target:
    """A performance target: ``worst`` over its sizes must be at least ``goal``."""

    text: str
    collective: str
    kind: str
    lo: int
    hi: int
    goal: float
    measure: Callable[[Run, int], float | None]
    worst: Callable[[Sequence[float]], float] = min


def speedup(baseline: str) -> Callable[[Run, int], float | None]:
    """``baseline time / mpitrain auto time`` at a size."""
    def ratio(run: Run, size: int) -> float | None:
        ours, other = run.result(size, _ours(run)), run.result(size, baseline)
        return other["time_us"] / ours["time_us"] if ours and other else None
    return ratio


def of_bound(run: Run, size: int) -> float | None:
    """mpitrain auto's bus bandwidth as a fraction of the direct-read bound."""
    ours = run.result(size, _ours(run))
    machine = run.doc["machine"]
    if not ours or "copy_gbps_all" not in machine:
        return None
    traffic = {"allreduce": 3 * run.ranks - 1, "reduce_scatter": run.ranks + 1,
               "allgather": 2 * (run.ranks - 1)}[run.collective]
    factor = {"allreduce": 2 * (run.ranks - 1) / run.ranks}.get(
        run.collective, (run.ranks - 1) / run.ranks)
    return float(ours["busbw"] / (machine["copy_gbps_all"] / traffic * factor))


TARGETS = (
    Target("allreduce >= 256 KiB: >= 1.5x native", "allreduce", "", 256 * KiB, 1 << 40,
           1.5, speedup("mpi")),
    Target("allreduce <= 16 KiB: latency <= 2x native (validation on)", "allreduce",
           "overhead", 0, 16 * KiB, 0.5, speedup("mpi")),
    Target("allreduce >= 64 MiB: >= 1.2x tuned native (malloc thresholds)", "allreduce",
           "malloc", 64 * MiB, 1 << 40, 1.2, speedup("mpi")),
    Target("reduce_scatter >= 16 KiB: >= 1.5x native Reduce_scatter_block", "reduce_scatter",
           "", 16 * KiB, 1 << 40, 1.5, speedup("mpi")),
    Target("allgather >= 64 KiB: >= 1.0x native Allgather", "allgather", "", 64 * KiB,
           1 << 40, 1.0, speedup("mpi")),
    Target("allreduce, every size: faster than gloo", "allreduce", "", 0, 1 << 40, 1.0,
           speedup("gloo")),
    Target("reduce_scatter, every size: faster than gloo", "reduce_scatter", "", 0, 1 << 40,
           1.0, speedup("gloo")),
    Target("allgather, every size: faster than gloo", "allgather", "", 0, 1 << 40, 1.0,
           speedup("gloo")),
    Target("allreduce >= 16 MiB: >= 60% of the direct-read bound", "allreduce", "", 16 * MiB,
           1 << 40, 0.6, of_bound),
)


def targets(runs: Sequence[Run]) -> list[str]:
    """The targets table: per target and rank count, the worst value and the verdict."""
    lines = ["| target | ranks | worst measured (size) | goal | met |", "|---|---|---|---|---|"]
    for t in TARGETS:
        for run in sorted((r for r in runs if r.collective == t.collective and r.kind == t.kind),
                          key=lambda r: r.ranks):
            values = [(v, s) for s in run.sizes() if t.lo <= s <= t.hi
                      for v in [t.measure(run, s)] if v is not None]
            if not values:
                continue
            value, size = min(values)
            verdict = "yes" if value >= t.goal else f"no, {value / t.goal:.0%} of the goal"
            shown = f"{value:.2f}" if t.measure is not of_bound else f"{value:.0%}"
            goal = f"{t.goal:.2f}" if t.measure is not of_bound else f"{t.goal:.0%}"
            lines.append(f"| {t.text} | {run.ranks} | {shown} ({human_size(size)}) | {goal} | "
                         f"{verdict} |")
    return lines


def render(runs: Sequence[Run], outdir: str) -> list[str]:
    """Per setup (:func:`setup_title`) its targets, then every table, by collective
    (links relative to ``outdir``)."""
    titles = {"": "", "inplace": ", in place", "malloc": ", tuned native malloc",
              "overhead": ", small messages with and without validation"}
    out = []
    for setup in sorted({r.setup for r in runs}):
        group = sorted((r for r in runs if r.setup == setup),
                       key=lambda r: (r.collective, r.kind))
        out += [f"## {setup_title(group[0])}", "", "### Targets", "",
                "Ratios are `baseline time / mpitrain time` (above 1: mpitrain is faster); "
                "the latency target is met when the ratio is at least 0.5 (mpitrain at most "
                "2x native's time).", "", *targets(group), ""]
        for run in group:
            out += [f"### {run.collective}, {run.ranks} ranks"
                    f"{titles.get(run.kind, run.kind)}", "", "```",
                    runnable(run.doc["command"], run.setup[0]),
                    "```", ""]
            machine = run.doc["machine"]
            if "copy_gbps_all" in machine:
                out += [f"Memory copy bandwidth: {machine['copy_gbps_one']:.1f} GB/s one "
                        f"rank, {machine['copy_gbps_all']:.1f} GB/s all ranks at once. "
                        f"{run.doc['settings']['iters']} timed runs per size; time = max "
                        "over ranks of each rank's median.", ""]
            out += table(run, inplace=run.kind == "inplace")
            png = os.path.splitext(run.path)[0] + ".png"
            if os.path.exists(png):
                out += ["", f"![{run.collective} {run.ranks} ranks]"
                            f"({os.path.relpath(png, outdir)})"]
            out.append("")
    return out


MAKE_BENCH_FLAGS = {False: "--allow-run-as-root --mca osc ^ucx",
                    True: "--allow-run-as-root --oversubscribe --bind-to none"}
"""How ``make bench`` started the ranks of a run, by whether they yield: ``BUSY`` (plain
``mpirun``, ranks pinned, as root) where they fit the cores, ``RUN``'s ``MPIFLAGS``
(oversubscribed, unpinned, yielding) where they do not."""


def runnable(command: str, yielding: bool) -> str:
    """A run's recorded command as it runs when pasted, as root too.

    Runs recorded before the harness wrote every launch flag (see
    :func:`benchmarks.common.command_line`) say ``mpirun [yield settings] -np N ...``;
    they came from ``make bench``, whose flags (:data:`MAKE_BENCH_FLAGS`, by whether the
    ranks yielded: ``yielding``) are added here.
    """
    words = command.split(" ")
    if "mpirun" not in words or "--allow-run-as-root" in words:
        return command
    at = words.index("mpirun")
    flags = MAKE_BENCH_FLAGS[yielding].split(" ")
    rest = words[at + 1:]
    if yielding and "-np" in rest:  # the yield settings stay, osc last as in MPIFLAGS
        at_np = rest.index("-np")
        rest = [*rest[:at_np], "--mca", "osc", "^ucx", *rest[at_np:]]
    return " ".join([*words[:at], "mpirun", *flags, *rest])


def train_tables(runs: Sequence[Run]) -> list[str]:
    """The training benchmark's runs (:mod:`benchmarks.train`): per run its command and
    one row per model and implementation."""
    out: list[str] = []
    for run in sorted(runs, key=lambda r: (r.setup, r.kind)):
        settings = run.doc["settings"]
        out += [f"### {setup_title(run)}, gradients {settings['compression']}", "", "```",
                runnable(run.doc["command"], run.setup[0]), "```", "",
                f"{settings['batch']} samples per rank and step, {settings['rounds']} rounds "
                f"x {settings['steps']} timed steps of each implementation; step = max over "
                "ranks of each rank's median.", "",
                "| model | parameters (tensors) | implementation | step | samples/s | "
                "scaling | gloo/impl | rel. diff | check |",
                "|---|---|---|---|---|---|---|---|---|"]
        steps = {(r["model"], r["impl"]): r["step_ms"] for r in run.doc["results"]}
        for r in run.doc["results"]:
            base = r["impl"] in BASELINES
            gloo = steps.get((r["model"], GLOO_OF.get(r["impl"], "")))
            ratio = f"{gloo / r['step_ms']:.2f}" if gloo and not base else "-"
            checked = not base and r["difference"] is not None \
                and not (isinstance(r["difference"], float) and math.isnan(r["difference"]))
            out.append(f"| {r['model']} | {r['params'] / 1e6:.2f} M ({r['tensors']}) | "
                       f"{r['impl']} | {human_time(r['step_ms'] * 1e3)} | "
                       f"{r['samples_per_s']:.1f} | {r['scaling']:.2f} | {ratio} | "
                       f"{format(r['difference'], '.1e') if checked else '-'} | "
                       f"{('OK' if r['ok'] else 'FAILED') if checked else '-'} |")
        bounds = scaling_bounds(run.doc)
        if bounds:
            out += ["", "Highest `gloo/impl` of DDP any implementation could reach, with "
                    f"communication that costs nothing (DDP's step over the `{NO_COMM}` "
                    "step, every rank training its own copy at once): "
                    + ", ".join(
                        f"{model} {bound:.2f}" for model, bound in bounds.items()) + "."]
        threads = thread_bounds(run.doc["results"], run.doc["machine"].get("cpus") or 0)
        if threads:
            out += ["", "Highest `gloo/impl` each implementation could reach if mpitrain's "
                    "threads cost nothing (the gloo step over the CPU time per step of the "
                    "implementation's training thread, which also does the framework's own "
                    "work, such as DDP's copies into its buckets, over either backend): "
                    + "; ".join(
                        f"{model} " + ", ".join(f"{impl} {b:.2f}" for impl, b in per.items())
                        for model, per in threads.items()) + "."]
        out.append("")
    return out


def thread_bounds(results: list[Row], cores: int) -> dict[str, dict[str, float]]:
    """Per model and mpitrain implementation of a training run (rows as dictionaries)
    on a host of ``cores`` cores, the highest ``gloo/impl`` it could reach if its own
    threads cost nothing: the gloo step of its kind over the CPU time per step of its
    training thread (``train_cpu_ms``, max over ranks), which no step can be shorter
    than. That thread also does what the framework does around any backend (DDP's
    copies of gradients into its buckets and back), so this bound, unlike the ``no
    comm`` one, counts it. None where the ranks share cores (a training thread then has
    less than a core, and its CPU time bounds nothing useful), nor for runs written
    before ``train_cpu_ms``."""
    steps = {(r["model"], r["impl"]): r["step_ms"] for r in results}
    bounds: dict[str, dict[str, float]] = {}
    for r in results:
        gloo = steps.get((r["model"], GLOO_OF.get(r["impl"], "")))
        thread = r.get("train_cpu_ms", math.nan)
        if r["impl"] in GLOO_OF.values() or not gloo or not thread or math.isnan(thread) \
                or r["ranks"] > cores:
            continue
        bounds.setdefault(r["model"], {})[r["impl"]] = gloo / thread
    return bounds


def scaling_bounds(doc: dict[str, Any]) -> dict[str, float]:
    """Per model of a training run, DDP's step time over the shortest step any data-
    parallel implementation could take: the ``no comm`` step, in which every rank trains
    its own copy at once and nothing is communicated (measured, not the one-rank step:
    ranks that compute at once share the cores, the memory bandwidth and the caches)."""
    steps: dict[str, dict[str, float]] = {}
    for r in doc["results"]:
        steps.setdefault(r["model"], {})[r["impl"]] = r["step_ms"]
    return {model: s["ddp"] / s[NO_COMM]
            for model, s in steps.items() if "ddp" in s and NO_COMM in s}


RATES = {"mbit": 1e6 / 8, "gbit": 1e9 / 8}  # bytes per second per unit of link rate


def link_rate(tag: str) -> float:
    """Bytes per second of a link rate as the multi-node files name it (``200mbit``)."""
    for unit, scale in RATES.items():
        if tag.endswith(unit):
            return float(tag[:-len(unit)]) * scale
    raise ValueError(f"unknown link rate {tag!r}")


def multinode(folder: str) -> list[str]:
    """Tables of ``benchmarks/multinode.sh``'s runs in ``folder``: per link rate and node
    count, mpitrain's flat ring and hierarchical (mean of the ``han`` and ``flat`` runs),
    native with ``coll/han`` and flat, and the inter-node bound ``2 (N-1)/N x size`` at
    the link rate."""
    runs: dict[tuple[str, int], dict[str, dict[tuple[int, str], float]]] = {}
    docs: dict[tuple[str, int], dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "allreduce-*-*n-*.json"))):
        _, rate, nodes, native = os.path.splitext(os.path.basename(path))[0].split("-")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        key = (rate, int(nodes[:-1]))
        runs.setdefault(key, {})[native] = {(r["size"], r["impl"]): r["time_us"]
                                            for r in doc["results"]}
        docs[key] = doc
    out: list[str] = []
    for (rate, nodes) in sorted(runs, key=lambda k: (link_rate(k[0]), k[1])):
        both = runs[(rate, nodes)]
        if set(both) != {"han", "flat"}:
            continue
        han, flat = both["han"], both["flat"]
        ranks = docs[(rate, nodes)]["machine"].get("ranks", 2 * nodes)
        out += [f"### {nodes} nodes x {ranks // nodes} ranks, {rate} links", "",
                "| size | ring (flat) | hierarchical | native, coll/han | native, flat "
                "(`coll ^han`) | ring/hier | han/hier | flat native/hier | inter-node bound "
                "| bound/hier |", "|---|---|---|---|---|---|---|---|---|---|"]
        for size in docs[(rate, nodes)]["settings"]["sizes"]:
            ring = (han[(size, "mpitrain:ring")] + flat[(size, "mpitrain:ring")]) / 2
            hier = (han[(size, "mpitrain:hierarchical")]
                    + flat[(size, "mpitrain:hierarchical")]) / 2
            h, f = han[(size, "mpi")], flat[(size, "mpi")]
            bound = 2 * size * (nodes - 1) / nodes / link_rate(rate) * 1e6
            out.append(f"| {human_size(size)} | {human_time(ring)} | {human_time(hier)} | "
                       f"{human_time(h)} | {human_time(f)} | {ring / hier:.2f} | "
                       f"{h / hier:.2f} | {f / hier:.2f} | {human_time(bound)} | "
                       f"{bound / hier:.0%} |")
        out.append("")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Write BENCHMARKS.md (or ``-o``) from the runs in ``DIR``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    p.add_argument("folder", help="directory of the JSON files of make bench")
    p.add_argument("-t", "--template", default=os.path.join(os.path.dirname(__file__),
                                                            "BENCHMARKS.template.md"))
    p.add_argument("-o", "--output", default="BENCHMARKS.md")
    a = p.parse_args(argv)
    runs = load(a.folder)
    if not runs:
        print(f"no <collective>-np<N>.json files in {a.folder}", file=sys.stderr)
        return 1
    with open(a.template, encoding="utf-8") as f:
        template = f.read()
    body = "\n".join(render(runs, os.path.dirname(os.path.abspath(a.output))))
    training = "\n".join(train_tables(load(a.folder, "train")))
    cluster = "\n".join(multinode(os.path.join(a.folder, "multinode")))
    with open(a.output, "w", encoding="utf-8") as f:
        f.write(template.replace("{{results}}", body).replace("{{train}}", training)
                .replace("{{multinode}}", cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
