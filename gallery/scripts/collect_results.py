"""Copy the JSON records a device call brought back into gallery/results/, one file per system, workload and
variant, named `<workload>--<system>[--<variant>].json`. Figures are copied untouched; only bookkeeping is
added: `device_call` (which call of the session measured it), `date` (the record's, else the file's time on the
device machine) and, for peers, the global batch in `variant` so that rows of different batches stay apart.

    python gallery/scripts/collect_results.py DEVICE_RESULTS_DIR CALL_LABEL [--only NAME ...]
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("call")
    ap.add_argument("--only", nargs="*", help="file names (without .json) to take; default all")
    args = ap.parse_args()
    for p in sorted(Path(args.folder).rglob("*.json")):
        if args.only and p.stem not in args.only:
            continue
        r = json.loads(p.read_text())
        if not isinstance(r, dict) or "system" not in r or "workload" not in r:
            continue
        r.setdefault("date", datetime.datetime.fromtimestamp(p.stat().st_mtime, datetime.timezone.utc)
                     .strftime("%Y-%m-%dT%H:%M:%SZ"))
        r["device_call"] = args.call
        if r["system"] != "moelab" and "global batch" not in str(r.get("variant", "")):
            r["variant"] = f"{r.get('variant', '')}, global batch {r['global_batch_size']}".lstrip(", ")
        if p.name.endswith("--moelab.json"):  # written by `moelab gallery run`: keep its name
            name = p.name
        else:
            variant = r.get("variant") or p.stem
            if r["system"] != "moelab":  # records that say compile (issue 17 on) name it: compile / eager, fp8
                fp8 = r.get("fp8", "off")
                tags = [r.get("experts_implementation", ""),
                        "" if "compile" not in r else ("compile" if r["compile"] else "eager"),
                        r.get("compile_mode", "") if r.get("compile") else "",  # trainer | blocks
                        f"fp8-{fp8}" if fp8 != "off" else "", f"clip{r['grad_clip']:g}" if r.get("grad_clip") else "",
                        f"gbs{r['global_batch_size']}"]
                variant = "-".join(t for t in tags if t)
            name = f"{r['workload']}--{r['system']}--{slug(variant)}.json"
        (RESULTS / name).write_text(json.dumps(r, indent=1) + "\n")
        print(name)


if __name__ == "__main__":
    main()
