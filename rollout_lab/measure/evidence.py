"""The index of the committed evidence: what each record in ``data/results/`` measured, with which
code, and whether it is current.

``data/results/index.json`` is the machine-readable index and ``data/results/README.md`` its
rendering. Both are generated from the records and from where they are cited:

- **current**: a record that the README names (today's figures);
- **cited**: a record that only ``docs/results.md`` or ``docs/history.md`` names (an earlier run,
  kept as the evidence for what those pages say about it);
- **archived**: a record under ``data/results/archive/`` (superseded or one-off, cited nowhere).

The one hand-kept part is each record's ``roles`` (e.g. ``"headline"``: the sweeps that
``make reproduce`` re-renders as the H200 table), which regeneration keeps. ``tests/test_records.py``
fails when the committed index differs from what regeneration gives.

    python -m rollout_lab.measure.evidence          # rewrite data/results/index.json and README.md
    records_with_role(Path("data/results"), "headline")

"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from rollout_lab.workspace import read_json_file, write_json_atomic, write_text_atomic

INDEX_FILE = "index.json"
INDEX_PAGE = "README.md"
ARCHIVE = "archive"
STATUSES = ("current", "cited", "archived")
CITING_PAGES = ("results.md", "history.md")  # under docs/: the pages that keep earlier runs' evidence


def measured(record: Mapping[str, Any]) -> str:
    """One line: the record's kind, model and what it ran."""
    config = record.get("config") or {}
    prov = record.get("provenance") or record.get("metadata") or {}
    model = config.get("model") or prov.get("model_name") or config.get("preset") or "?"
    kind = record.get("kind", "calibration")
    if kind == "sweep":
        what = f"{len(record.get('workloads', {}))} workloads x {config.get('max_new_tokens')} tokens, " \
               f"paths {', '.join(config.get('paths', []))}"
    elif "workload" in record and "num_requests" in record["workload"]:
        what = f"{record['workload']['num_requests']} requests, paths {', '.join(record.get('results', {}))}"
    elif "results" in record:
        what = f"paths {', '.join(record['results'])}"
    elif "variants" in record:
        what = f"variants {', '.join(record['variants'])}"
    elif "cases" in record and all(isinstance(c, Mapping) and "results" in c for c in record["cases"]):
        paths = dict.fromkeys(p for c in record["cases"] for p in c["results"])  # a prefix-sharing record
        what = f"{record.get('workload', {}).get('name', '?')}, paths {', '.join(paths)}"
    elif "cases" in record:
        what = f"cases {', '.join(record['cases'])}"
    else:
        what = ""
    return f"{kind}: {model}" + (f", {what}" if what else "")


def _mentions(text: str, path: Path) -> bool:
    """Whether a page names the record: its file name, or its stem as a whole word (a table's
    ``sweep_<...>_notebook-03`` without the ``.json``)."""
    return path.name in text or re.search(rf"(?<![\w.-]){re.escape(path.stem)}(?![\w-])", text) is not None


def build_index(root: Path) -> dict[str, Any]:
    """The index of ``root``'s ``data/results`` (a checkout), keeping the roles of its current index."""
    results = root / "data" / "results"
    old = read_index(results) if (results / INDEX_FILE).is_file() else {"records": {}}
    readme = (root / "README.md").read_text(encoding="utf-8")
    cited = "\n".join((root / "docs" / page).read_text(encoding="utf-8") for page in CITING_PAGES)
    entries, uncited = {}, []
    for path in sorted(results.glob("*.json")) + sorted((results / ARCHIVE).glob("*.json")):
        if path.name == INDEX_FILE:
            continue
        record = read_json_file(path, what="record", max_bytes=256 * 2**20)
        prov = record.get("provenance") or record.get("metadata") or {}
        name = str(path.relative_to(results))
        status = "archived" if path.parent.name == ARCHIVE else "current" if _mentions(readme, path) else \
            "cited" if _mentions(cited, path) else None
        if status is None:
            uncited.append(name)
            continue
        entries[name] = {"measured": measured(record), "git_sha": str(prov.get("git_sha") or "")[:7],
                         "date": str(prov.get("date") or "")[:10], "device": prov.get("device_name"),
                         "dtype": prov.get("dtype"), "status": status,
                         "roles": list(old["records"].get(name, {}).get("roles", []))}
    if uncited:
        raise ValueError(f"{', '.join(uncited)}: cited by neither README.md nor docs/{' nor docs/'.join(CITING_PAGES)}; cite them, or "
                         f"move them (with their CSV twins) into data/results/{ARCHIVE}/")
    return {"records": entries}


def read_index(results: Path) -> dict[str, Any]:
    """``results``'s index (``INDEX_FILE``): {"records": {file: entry}}."""
    index = read_json_file(results / INDEX_FILE, what="records index", max_bytes=2**20)
    if not isinstance(index, dict) or not isinstance(index.get("records"), dict):
        raise ValueError(f"{results / INDEX_FILE} must hold {{'records': {{file: entry}}}}")
    return index


def records_with_role(results: Path, role: str) -> list[Path]:
    """The records the index gives ``role``, in the index's order (empty without an index)."""
    if not (results / INDEX_FILE).is_file():
        return []
    return [results / name for name, entry in read_index(results)["records"].items() if role in entry.get("roles", [])]


def index_markdown(index: Mapping[str, Any]) -> str:
    """The index as ``data/results/README.md``."""
    lines = ["# data/results: the committed records", "",
             "Generated by `python -m rollout_lab.measure.evidence` from the records and from where they are "
             "cited; do not edit by hand. Each JSON has a CSV twin with the same `run_id`. *current*: "
             "named by the README (today's figures); *cited*: an earlier run that `docs/results.md` or "
             "`docs/history.md` cites; *archived*: superseded or one-off, in `archive/`.", "",
             "| record | measured | git | date | device, dtype | status | roles |",
             "|---|---|---|---|---|---|---|"]
    for name, e in index["records"].items():
        lines.append(f"| [`{name}`]({name}) | {e['measured']} | `{e['git_sha']}` | {e['date']} | "
                     f"{e['device']}, {e['dtype']} | {e['status']} | {', '.join(e['roles'])} |")
    return "\n".join(lines) + "\n"


def write_index(root: Path) -> dict[str, Any]:
    """Rewrite ``data/results/index.json`` and its README from the records; returns the index."""
    index = build_index(root)
    results = root / "data" / "results"
    write_json_atomic(results / INDEX_FILE, index)
    write_text_atomic(results / INDEX_PAGE, index_markdown(index))
    return index


if __name__ == "__main__":
    written = write_index(Path.cwd())
    print(f"indexed {len(written['records'])} records in data/results/{INDEX_FILE} and {INDEX_PAGE}")
