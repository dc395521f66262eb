#!/usr/bin/env python3
"""plot_log.py -- draw the curves of one or more train_roundpipe --log files.

    scripts/plot_log.py run.jsonl -o loss.png
    scripts/plot_log.py a.jsonl b.jsonl --x tokens -o compare.png

Three panels over steps (or tokens trained): the training loss with the validation loss (dashed),
the learning rate, and tokens/s. Several logs are overlaid, one colour each, labelled with their
file names. A log that a resumed run appended to is read as that run saw it: a {"resume": N}
record drops what the log held for the steps after N (a run killed after its last checkpoint
logged them once before). Steps whose learning rate is null (the delayed engine's first step,
which applies no update) have no lr point.

Needs matplotlib (pip install matplotlib); reads only the JSON lines, so any log of this trainer
works, also an unfinished one.
"""

import argparse
import json
import os
import sys


def read_log(path):
    """{step: record} of the step records and {step: val_loss}, resume markers applied."""
    steps, vals = {}, {}
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                # a run killed mid-write leaves half a line: skip it, say so
                print("%s:%d: not JSON, skipped" % (path, lineno), file=sys.stderr)
                continue
            if "resume" in rec:
                at = rec["resume"]
                steps = {s: r for s, r in steps.items() if s <= at}
                vals = {s: v for s, v in vals.items() if s <= at}
            elif "val_loss" in rec:
                vals[rec["step"]] = rec["val_loss"]
            elif "loss" in rec:
                steps[rec["step"]] = rec
    return steps, vals


def num(x):
    return float("nan") if x is None else float(x)


def main():
    ap = argparse.ArgumentParser(description="Plot loss, validation loss, lr and tokens/s of "
                                 "train_roundpipe --log files.")
    ap.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines logs (--log FILE)")
    ap.add_argument("-o", "--out", default="loss.png", help="output image (default loss.png; "
                    ".svg and .pdf work too)")
    ap.add_argument("--x", choices=["steps", "tokens"], default="steps",
                    help="x axis: optimizer steps or tokens trained (default steps)")
    ap.add_argument("--title", default=None, help="figure title")
    args = ap.parse_args()

    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_log.py: needs matplotlib: pip install matplotlib")

    runs = []
    for path in args.logs:
        try:
            steps, vals = read_log(path)
        except OSError as e:
            raise SystemExit("plot_log.py: %s: %s" % (path, e.strerror))
        if not steps and not vals:
            raise SystemExit("plot_log.py: %s: no step or evaluation records" % path)
        runs.append((path, steps, vals))

    fig, (ax_loss, ax_lr, ax_tok) = plt.subplots(3, 1, sharex=True, figsize=(9, 9),
                                                  gridspec_kw={"height_ratios": [3, 1, 1]})
    for i, (path, steps, vals) in enumerate(runs):
        color = "C%d" % (i % 10)
        label = os.path.basename(path)
        order = sorted(steps)
        # tokens per step from the log itself (B x T); logs written before the "tokens" field
        # existed can only be drawn over steps
        per_step = None
        for s in order:
            if steps[s].get("tokens"):
                per_step = steps[s]["tokens"] / s
                break
        if args.x == "tokens" and per_step is None:
            raise SystemExit("plot_log.py: %s has no \"tokens\" field (an older log): use --x steps"
                             % path)
        scale = per_step if args.x == "tokens" else 1.0
        xs = [s * scale for s in order]
        ax_loss.plot(xs, [num(steps[s]["loss"]) for s in order], color=color, lw=1.2,
                     label=label)
        if vals:
            vs = sorted(vals)
            ax_loss.plot([s * scale for s in vs], [num(vals[s]) for s in vs], color=color,
                         ls="--", marker="o", ms=3, lw=1.2, label=label + " (val)")
        ax_lr.plot(xs, [num(steps[s].get("lr")) for s in order], color=color, lw=1.2)
        ax_tok.plot(xs, [num(steps[s].get("tok_s")) for s in order], color=color, lw=1.0)

    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    ax_lr.set_ylabel("lr")
    ax_lr.grid(alpha=0.3)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax_tok.set_ylabel("tokens/s")
    ax_tok.grid(alpha=0.3)
    ax_tok.set_xlabel("tokens trained" if args.x == "tokens" else "step")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    out_dir = os.path.dirname(args.out)
    if out_dir and not os.path.isdir(out_dir):
        raise SystemExit("plot_log.py: %s: no such folder" % out_dir)
    fig.savefig(args.out, dpi=120)
    print("wrote %s (%d run%s)" % (args.out, len(runs), "" if len(runs) == 1 else "s"))


if __name__ == "__main__":
    main()
