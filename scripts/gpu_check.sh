#!/usr/bin/env bash
# The device checks, as one script (run on a machine with a CUDA GPU and torch installed):
# the whole suite (CUDA-marked tests included) and the benchmark on the GPU. Writes to $OUT.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider --maxfail=10 -k "not subprocess_entry_points" 2>&1 | tail -40 | tee "$OUT/tests.txt"
timeout 240 python3 scripts/bench.py --device cuda --reps 30 --no-cold --json "$OUT/bench-cuda.json" 2>&1 | tee "$OUT/bench-cuda.txt"
