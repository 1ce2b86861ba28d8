"""Writing results: one run's JSON and Markdown, and the GPU check's combined report.

    python benchmarks/_report.py slug "NVIDIA H200"          # nvidia-h200
    python benchmarks/_report.py environment --device cuda   # versions and GPUs; fails without CUDA
    python benchmarks/_report.py gpu-check --sections FILE [--bench FILE] [--gpu NAME] --out-stem PATH

``gpu-check`` is what ``tools/gpu_check.sh`` calls last: it reads the sections' outcomes (one
tab-separated line each: name, status, exit code, seconds, log file) and the benchmark's JSON if
there is one, and writes PATH.json and PATH.md. A status is ``passed``, ``skipped: ...`` (a dry
run's section whose tests need CUDA) or anything else, a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

LOG_TAIL = 4000  # characters of each section's log kept in the report


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def machine(device: str, threads: Sequence[int]) -> Dict[str, Any]:
    import torch

    import amp_bn_fix
    from _harness import available_cpus, device_path_unavailable

    config = amp_bn_fix.get_config()
    info: Dict[str, Any] = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_available": available_cpus(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": list(threads),
        "os": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "amp_bn_fix": amp_bn_fix.__version__,
        "shim_settings": ", ".join(f"{name}={config.describe(name)}" for name in ("policy", "devices", "guard", "keep_fp32")),
        "device_path_variant": device_path_unavailable() or "available",
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def payload(bench: Any, info: Dict[str, Any], load_before: str) -> Dict[str, Any]:
    """Everything one run recorded, as JSON-ready data (``bench``: a ``_harness.Bench``)."""
    return {
        "machine": {**info, "load_average_at_start": load_before, "load_average_at_end": load_average()},
        "quick": bench.quick,
        "rows": [dataclasses.asdict(r) for r in bench.rows],
        "figures": [dataclasses.asdict(f) for f in bench.figures],
        "notes": bench.notes,
        "errors": bench.errors,
        **bench.extra,
    }


def _us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.2f} us"


def _value(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def _grouped(items: List[Dict[str, Any]]) -> Dict[Tuple[str, str, str, str, str], Dict[int, Dict[str, Any]]]:
    cells: Dict[Tuple[str, str, str, str, str], Dict[int, Dict[str, Any]]] = {}
    for item in items:
        cells.setdefault((item["row"], item["section"], item["name"], item["a"], item["b"]), {})[item["threads"]] = item
    return cells


def _row_label(row: str, section: str) -> str:
    """The row's name, and the section label benchmarks/README.md uses (P1 ...) where it differs."""
    return row if row.startswith(section) else f"{row} ({section})"


def _notes(by_threads: Dict[int, Dict[str, Any]]) -> str:
    distinct = {item["note"] for item in by_threads.values() if item["note"]}
    if len(distinct) <= 1:
        return distinct.pop() if distinct else ""
    return "; ".join(f"{n}t: {item['note']}" for n, item in by_threads.items() if item["note"])


def markdown(data: Dict[str, Any], heading: str = "#") -> str:
    """The Markdown of one run's ``payload``."""
    info = data["machine"]
    threads = [int(n) for n in info["torch_threads"]]
    lines = [f"{heading} amp_bn_fix benchmark ({info['device']}{', quick' if data.get('quick') else ''})", ""]
    lines += ["| machine | |", "|---|---|"]
    lines += [f"| {k} | {', '.join(map(str, v)) if isinstance(v, list) else v} |" for k, v in info.items()]
    columns = " | ".join(_threads(n) for n in threads)
    if data["rows"]:
        lines += ["", "Ratio A/B: A's time over B's, lower is faster for A (1.00: a tie); the median of paired ratios, "
                  "[interquartile range]; times (A / B) are medians. One column per torch thread count. Targets are "
                  "the project's, printed for reading, not checked.", ""]
        lines += [f"| row | case | A | B | {columns} | target |", "|---|---|---|---|" + "---|" * len(threads) + "---|"]
        for (row, section, name, a, b), by_threads in _grouped(data["rows"]).items():
            notes = _notes(by_threads)
            cells = [_row_label(row, section), name + (f" ({notes})" if notes else ""), a, b]
            for n in threads:
                t = by_threads.get(n, {}).get("timing")
                cells.append("" if t is None else f"{t['ratio']:.3f} [{t['ratio_q1']:.3f}, {t['ratio_q3']:.3f}] "
                             f"({_us(t['a_us'])} / {_us(t['b_us'])})")
            cells.append(next((item["target"] for item in by_threads.values() if item["target"]), ""))
            lines.append("| " + " | ".join(cells) + " |")
    if data.get("figures"):
        lines += ["", "Counts and sizes: A / B (A - B).", ""]
        lines += [f"| row | case | A | B | {columns} | target |", "|---|---|---|---|" + "---|" * len(threads) + "---|"]
        for (row, section, name, a, b), by_threads in _grouped(data["figures"]).items():
            notes = _notes(by_threads)
            cells = [_row_label(row, section), name + (f" ({notes})" if notes else ""), a, b]
            for n in threads:
                f = by_threads.get(n)
                if f is None:
                    cells.append("")
                    continue
                extra = ""
                if f["a_value"] is not None and f["b_value"] is not None:
                    diff = f["a_value"] - f["b_value"]
                    extra = f" ({'+' if diff >= 0 else ''}{_value(diff)})"
                cells.append(f"{_value(f['a_value'])} / {_value(f['b_value'])} {f['unit']}{extra}")
            cells.append(next((item["target"] for item in by_threads.values() if item["target"]), ""))
            lines.append("| " + " | ".join(cells) + " |")
        ops = [f for f in data["figures"] if f["unit"] == "ops" and f["detail"].get("shim_ops") is not None]
        if ops:
            lines += ["", "The ops counted (first thread count), shim / off:", ""]
            seen = set()
            for f in ops:
                if f["name"] in seen:
                    continue
                seen.add(f["name"])
                lines.append(f"- {f['name']}: {' '.join(f['detail']['shim_ops'])} / {' '.join(f['detail']['off_ops'])}")
    if data.get("p3_profile_ms"):
        prof = data["p3_profile_ms"]
        lines += ["", f"{heading}# Where a P3 step goes (bf16 {tuple(prof['shape'])}, self CPU ms per step)", ""]
        for n, profiles in prof["top_ops"].items():
            for label, ops in profiles.items():
                lines += [f"{_threads(int(n))}, {label}: " + ", ".join(f"{k} {ms:.2f}" for k, ms in ops), ""]
    if data.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {note}" for note in data["notes"]]
    if data.get("errors"):
        lines += ["", "Errors (these rows did not finish):", ""]
        lines += [f"- {e['row']} at {e['threads']} threads: {e['error']}" for e in data["errors"]]
    return "\n".join(lines).rstrip("\n") + "\n"


def write(data: Dict[str, Any], out_dir: Path, stem: str) -> Tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    md_path.write_text(markdown(data))
    return json_path, md_path


# --- the GPU check's report -------------------------------------------------------------------


def read_sections(path: Path) -> List[Dict[str, Any]]:
    sections = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, status, rc, seconds, log = (line.split("\t") + [""] * 5)[:5]
        tail = ""
        if log and Path(log).is_file():
            tail = Path(log).read_text(errors="replace")[-LOG_TAIL:]
        sections.append({"name": name, "status": status, "exit_code": int(rc) if rc.lstrip("-").isdigit() else None,
                         "seconds": int(seconds) if seconds.isdigit() else None, "log": log, "log_tail": tail})
    return sections


def gpu_check_report(sections: List[Dict[str, Any]], bench: Optional[Dict[str, Any]], gpu: str) -> Tuple[Dict[str, Any], str]:
    # "skipped" is a dry run's section that needs CUDA; a section not run for want of time is a failure.
    skipped = [s["name"] for s in sections if s["status"].startswith("skipped")]
    failed = [s["name"] for s in sections if s["status"] != "passed" and s["name"] not in skipped]
    data = {"kind": "gpu-check", "gpu": gpu, "sections": sections, "failed": failed, "skipped": skipped, "bench": bench}
    lines = [f"# amp_bn_fix GPU check ({gpu})", "",
             "Produced by `tools/gpu_check.sh`: each section's outcome, then the benchmark's CUDA rows.", "",
             "| section | status | exit code | seconds |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['exit_code']} | {s['seconds'] if s['seconds'] is not None else ''} |"
              for s in sections]
    lines += ["", f"Failed sections: {', '.join(failed)}" if failed else "No section failed." if skipped
              else "Every section passed."]
    if skipped:
        lines += ["", f"Skipped sections: {', '.join(skipped)}"]
    for s in sections:
        if s["name"] in failed and s["log_tail"]:
            lines += ["", f"## {s['name']}: the end of its log", "", "```", s["log_tail"].rstrip(), "```"]
    if bench is not None:
        lines += ["", markdown(bench, heading="##")]
    else:
        lines += ["", "No benchmark results (the benchmark section did not write any)."]
    return data, "\n".join(lines).rstrip("\n") + "\n"


def environment(device: str) -> int:
    """Print the versions and the GPUs; 1 when ``device`` is cuda and none is usable."""
    import shutil
    import subprocess

    import torch

    import amp_bn_fix

    print("python", platform.python_version(), sys.executable)
    print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())
    print("amp_bn_fix", amp_bn_fix.__version__, "from", amp_bn_fix.__file__)
    available = torch.cuda.is_available()
    print("CUDA available:", available)
    for i in range(torch.cuda.device_count() if available else 0):
        p = torch.cuda.get_device_properties(i)
        print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi"], check=False)
    return 0 if available or device != "cuda" else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    name = commands.add_parser("slug", help="a file-name form of a device name")
    name.add_argument("name")
    env = commands.add_parser("environment", help="print the versions and GPUs; fail on --device cuda without one")
    env.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    check = commands.add_parser("gpu-check", help="combine the GPU check's sections and benchmark into one report")
    check.add_argument("--sections", type=Path, required=True)
    check.add_argument("--bench", type=Path)
    check.add_argument("--gpu", default="unknown GPU", help="the GPU's name, for the title")
    check.add_argument("--out-stem", type=Path, required=True, help="writes OUT_STEM.json and OUT_STEM.md")
    args = parser.parse_args(argv)
    if args.command == "slug":
        print(slug(args.name))
        return 0
    if args.command == "environment":
        return environment(args.device)
    bench = json.loads(args.bench.read_text()) if args.bench is not None and args.bench.is_file() else None
    data, md = gpu_check_report(read_sections(args.sections), bench, args.gpu)
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = Path(f"{args.out_stem}.json"), Path(f"{args.out_stem}.md")
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    md_path.write_text(md)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
