#!/usr/bin/env bash
# One-shot, idempotent set-up: creates .venv/ at the repository root with lightning_rec (editable),
# its pinned CPU stack and the test tools (pytest, hypothesis, tensorboard for Lightning's TensorBoardLogger:
# all in pyproject's `test` extra, pinned where requirements/constraints-cpu.txt pins them).
#
# Why not a plain `pip install -e .`: torchrec's metadata requires the CUDA `fbgemm-gpu` package,
# which cannot load on a CPU-only machine (libtorch_cuda.so is missing), and a bare `torch`
# requirement makes pip pull a multi-GB CUDA build. So torch is pinned through a constraints file,
# torchrec is installed without its declared dependencies, and its real dependencies are installed
# explicitly with the CPU build of FBGEMM (`fbgemm-gpu-cpu`).
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
"${PIP[@]}" install "${FIND[@]}" -c "$CONSTRAINTS" -e ".[test]"
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
