#!/usr/bin/env bash
# One-shot, idempotent set-up: creates .venv/ at the repository root with lightning_rec (editable),
# its pinned CPU stack and the test tools (pytest, hypothesis, tensorboard for Lightning's TensorBoardLogger:
# all in pyproject's `test` extra, pinned where requirements/constraints-cpu.txt pins them).
#
# Why not a plain `pip install -e .`: from PyPI alone, torchrec's and pyproject's `fbgemm-gpu` is the CUDA build,
# which cannot load on a CPU-only machine (libtorch_cuda.so is missing), and `torch` is a multi-GB CUDA build.
# Users get the CPU builds from the PyTorch CPU index (README "Install"); this machine reaches PyPI only. So torch is
# pinned through a constraints file (its CPU wheel), torchrec is installed without its declared dependencies, its real
# dependencies are installed explicitly with PyPI's CPU build of FBGEMM (`fbgemm-gpu-cpu`), and this project is
# installed with --no-deps after the rest of pyproject's requirements.
#
# GPU machines: set LIGHTNING_REC_FBGEMM=fbgemm-gpu (and a CUDA build of torch) to install the
# matching CUDA FBGEMM instead; see README "GPU set-up".
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
FBGEMM=${LIGHTNING_REC_FBGEMM:-fbgemm-gpu-cpu}
CONSTRAINTS=requirements/constraints-cpu.txt

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# The CPU torch wheel may be on local disk; use it when it is there.
FIND=()
[ -d /opt/wheels ] && FIND=(--find-links /opt/wheels)

"${PIP[@]}" install "${FIND[@]}" -c "$CONSTRAINTS" torch
"${PIP[@]}" install "${FIND[@]}" -c "$CONSTRAINTS" -r requirements/torchrec-deps.txt "$FBGEMM"
# pyproject's requirements, its test extra and its `ray` extra, less torchrec and fbgemm-gpu (above and below): as
# requirements, they would bring the CUDA fbgemm-gpu and torchrec's torchmetrics==1.0.3 pin. Then the project itself,
# editable.
REQS=$(mktemp)
trap 'rm -f "$REQS"' EXIT
.venv/bin/python - >"$REQS" <<'PY'
import re
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
# The test extra, and the optional integrations the tests exercise (`ray`: tests/integrations/test_ray.py; `retrieval`:
# faiss-cpu, tests/test_retrieval.py).
for requirement in project["dependencies"] + extras["test"] + extras["ray"] + extras["retrieval"]:
    if not re.match(r"(torchrec|fbgemm-gpu)\b", requirement):
        print(requirement)
PY
"${PIP[@]}" install "${FIND[@]}" -c "$CONSTRAINTS" -r "$REQS"
"${PIP[@]}" install "${FIND[@]}" -c "$CONSTRAINTS" --no-deps -e .
# Last, so that pip's resolver does not report torchrec's undeclarable CUDA requirement as a conflict.
"${PIP[@]}" install "${FIND[@]}" -c "$CONSTRAINTS" --no-deps torchrec
# If anything above pulled the CUDA fbgemm-gpu (it shares the fbgemm_gpu import package with the CPU
# build), remove it and restore the CPU build's files.
if [ "$FBGEMM" = fbgemm-gpu-cpu ] && .venv/bin/python -m pip show -q fbgemm-gpu >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y fbgemm-gpu
  "${PIP[@]}" install "${FIND[@]}" -c "$CONSTRAINTS" --force-reinstall --no-deps fbgemm-gpu-cpu
fi
.venv/bin/python - <<'PY'
import torch, fbgemm_gpu, torchrec, lightning  # noqa: F401  (fails loudly if FBGEMM cannot load)
import lightning_rec
import tensorboard  # noqa: F401  (the test extra: TensorBoardLogger)
print(f"ok: torch {torch.__version__}, torchrec {torchrec.__version__ if hasattr(torchrec, '__version__') else '?'}, "
      f"lightning {lightning.__version__}, lightning_rec {lightning_rec.__version__}")
PY
