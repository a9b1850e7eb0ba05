# shellcheck shell=bash
# Sourced by .ci/run and .ci/check-extras, from the repository root: ROOT, PYTHON, a temporary WORK folder
# (removed on exit), pip's configuration and cache, and `fresh_env`, which runs a command as a newcomer would
# (a new virtual environment, an empty home folder, empty caches).
ROOT="$PWD"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# What stays from this machine: pip's own configuration (which package indexes it may reach) and pip's download
# cache. Neither can stand in for a missing dependency (pip still resolves every requirement), and they keep the
# run from downloading the same wheels twice.
if [ -z "${PIP_CONFIG_FILE:-}" ] && [ -f "$HOME/.config/pip/pip.conf" ]; then
    export PIP_CONFIG_FILE="$HOME/.config/pip/pip.conf"
fi
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$("$PYTHON" -m pip cache dir 2>/dev/null || echo "$WORK/pip-cache")}"

# fresh_env NAME COMMAND [ARG ...]: makes the venv $WORK/NAME-venv and the empty home $WORK/NAME-home (its caches
# inside it), then runs COMMAND (a program or a shell function) in a subshell in the repository root, with the venv
# active and HOME and the caches pointing into that home. Returns COMMAND's exit status.
fresh_env() {
    local name="$1"
    local home="$WORK/$name-home"
    mkdir -p "$home"
    "$PYTHON" -m venv "$WORK/$name-venv"
    (
        # shellcheck source=/dev/null
        source "$WORK/$name-venv/bin/activate"
        export HOME="$home" XDG_CACHE_HOME="$home/.cache" HF_HOME="$home/.cache/huggingface"
        export DSPARK_HF_CACHE="$home/.cache/dspark_hf" TORCH_EXTENSIONS_DIR="$home/.cache/torch_extensions"
        cd "$ROOT" || exit
        "${@:2}"
    )
}
