# Sourced by the peer set-up scripts (setup_vllm.sh, setup_llamacpp.sh), from the repo root.
#   peer_venv TAG DIR   creates the venv DIR with $PYTHON (default python3) unless it
#                       exists, and sets VENV=DIR and PIP=(quiet pip install in it).
peer_venv() {
  local tag="$1"
  VENV="$2"
  local python="${PYTHON:-python3}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[$tag] creating $VENV"
    "$python" -m venv "$VENV"
  fi
  PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
}
