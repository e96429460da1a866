"""The code examples of README.md, of the docs pages and of the public modules' docstrings run.

Every ```python block of README.md, docs/*.md and docs/guide/*.md is either run or listed in
``NOT_RUN`` with the reason (a new block is neither: the test fails). Docstring examples (a
block indented by 4 spaces after a blank line) of ``DOCSTRING_MODULES`` are all run. They run in one separate process
(``doc_examples_worker.py``: a one-rank gloo group, a tiny FSDP2 model, the names the examples
use); the ``CheckpointManager`` resume loop (README and ``manager.py``) must give, resumed, the
final weights and optimizer state of an uninterrupted run bit for bit. Two planted broken
examples (one raising, the old resume loop that trains the saved step twice) must be reported
broken: the harness catches what it is for.

Its tests that start processes are in ``tests/integration/test_doc_examples_processes.py``.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))  # tests/unit/ -> the repository root
SRC = os.path.join(REPO, "src", "unickpt")

DOC_FILES = ("README.md", "docs/*.md", "docs/guide/*.md")  # docs/integrations/ have tests of their own
NOT_RUN = {  # first line of the block -> why it is not run here
    'unickpt.save(path, state, *, framework="auto"': "signatures, not code",
    "import s3fs": "needs an S3 server (tests/integration/storage/test_s3_walkthrough.py runs it against SeaweedFS)",
    "model_chunks, optimizer = ...": "needs megatron-core (tests/integration/megatron/)",
    "from unickpt.data import TokenPackingLoader": "needs token files and 100+ batches (tests/integration/data/)",
    "from google.cloud import storage": "needs a GCS server (tests/integration/storage/test_gcs_walkthrough.py runs it "
    "against fake-gcs-server)",
    'tiers = unickpt.TieredCheckpointManager("shm://job1", "s3://bucket/job1",': "needs several hosts and an S3 "
    "server (tests/integration/storage/test_recovery_processes.py runs the tier on simulated hosts)",
}
DOCSTRING_MODULES = ("manager.py", "api.py", "checkpointer.py", "monitoring/sinks.py")
RESUME_MARK = "manager.load_latest("  # the CheckpointManager resume loop: checked bit for bit


def doc_blocks() -> list[tuple[str, str]]:
    """Every ```python block of ``DOC_FILES``: ``(file:line, code)``."""
    out = []
    for pattern in DOC_FILES:
        for path in sorted(glob.glob(os.path.join(REPO, pattern))):
            text = open(path).read()
            rel = os.path.relpath(path, REPO)
            for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M):
                out.append((f"{rel}:{text[: m.start()].count(chr(10)) + 1}", textwrap.dedent(m.group(2))))
    return out


def docstring_blocks(relpath: str) -> list[tuple[str, str]]:
    """The examples in the docstrings of one module: ``(where, code)``."""
    tree = ast.parse(open(os.path.join(SRC, relpath)).read())
    out = []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        lines = (doc or "").splitlines()
        i = 0
        while i < len(lines):
            if lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()):
                j = i
                while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                    j += 1
                name = getattr(node, "name", "module")
                out.append((f"{relpath}:{name}", textwrap.dedent("\n".join(lines[i:j])).strip() + "\n"))
                i = j
            else:
                i += 1
    return out


def snippets() -> list[dict[str, str]]:
    found = []
    for where, code in doc_blocks():
        first = code.splitlines()[0]
        if any(first.startswith(k) for k in NOT_RUN):
            continue
        found.append({"name": where, "code": code})
    for rel in DOCSTRING_MODULES:
        found += [{"name": where, "code": code} for where, code in docstring_blocks(rel)]
    for s in found:
        s["kind"] = "resume" if RESUME_MARK in s["code"] else "run"
    return found


def test_every_doc_block_is_run_or_has_a_reason():
    firsts = [code.splitlines()[0] for _, code in doc_blocks()]
    for key in NOT_RUN:  # no stale reason
        assert any(f.startswith(key) for f in firsts), key
    names = [s["name"] for s in snippets()]
    assert any(n.startswith("manager.py") for n in names) and any(n.startswith("checkpointer.py") for n in names)
    assert sum(s["kind"] == "resume" for s in snippets()) == 2  # README's and manager.py's


def test_issue39_item25_migrating_has_a_complete_resume_after_convert_from_dcp():
    """docs/migrating.md shows the whole resume after ``convert --from dcp`` (where the scheduler
    lands, how it is restored, how it is saved afterwards), and the block is one of those
    ``test_doc_examples_run`` runs (not in ``NOT_RUN``)."""
    run = {s["name"]: s["code"] for s in snippets()}
    resume = [
        code
        for name, code in run.items()
        if name.startswith("docs/migrating.md") and '"convert", "--from", "dcp"' in code
    ]
    assert len(resume) == 1, sorted(run)
    code = resume[0]
    assert 'scheduler.load_state_dict(state["extra_state"]["lr_scheduler"])' in code
    assert 'unickpt.load("ckpts/' in code and '"lr_scheduler": scheduler' in code  # restored, then saved as itself
    one_rank = [c for n, c in run.items() if n.startswith("docs/migrating.md") and "SaveOptions(timeout=" in c]
    assert len(one_rank) == 1
