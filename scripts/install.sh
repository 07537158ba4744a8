#!/usr/bin/env bash
# Set up toymlx on this machine (macOS on Apple Silicon, Debian/Ubuntu, other Linux):
#
#   source scripts/install.sh    # bash or zsh: installs, and leaves the environment active
#   bash scripts/install.sh      # installs, and prints how to activate the environment
#
# Into the active virtual environment or conda env if there is one, else into .venv in this
# checkout (created from a Python >= 3.10, or reused). TOYMLX_EXTRAS=interop,report adds
# extras; TOYMLX_PYTHON=/path/to/python3.X picks the Python that .venv is made from.
# The work is done by scripts/install_env.sh in its own strict bash; this file only runs it
# and activates the result, so that sourcing it changes nothing else in your shell (no shell
# options, and none of its own variables or functions are left behind) and a failure ends
# in one error line and a non-zero status, never an exit of your shell.

if [ -n "${ZSH_VERSION:-}" ]; then
  eval '_toymlx_here=${(%):-%x}'      # zsh: the file being sourced or run
  case ${ZSH_EVAL_CONTEXT:-} in *:file*) _toymlx_sourced=1 ;; *) _toymlx_sourced=0 ;; esac
elif [ -n "${BASH_VERSION:-}" ]; then
  eval '_toymlx_here=${BASH_SOURCE[0]}'
  if [ "$_toymlx_here" != "$0" ]; then _toymlx_sourced=1; else _toymlx_sourced=0; fi
else                                   # another sh can run this file, not source it
  _toymlx_here=$0
  _toymlx_sourced=0
fi

case $_toymlx_here in
  */install.sh | install.sh) _toymlx_env=$(bash "$(dirname "$_toymlx_here")/install_env.sh") ;;
  *) echo "toymlx: error: source scripts/install.sh from bash or zsh, or run: bash scripts/install.sh" >&2
     false ;;
esac
_toymlx_rc=$?
if [ "$_toymlx_rc" -ne 0 ]; then
  :  # install_env.sh has said why
elif [ "$_toymlx_sourced" = 1 ]; then
  if [ "${VIRTUAL_ENV:-}" != "$_toymlx_env" ] && [ "${CONDA_PREFIX:-}" != "$_toymlx_env" ]; then
    . "$_toymlx_env/bin/activate"
    _toymlx_rc=$?
  fi
  if [ "$_toymlx_rc" -eq 0 ]; then
    echo "toymlx: ready: $_toymlx_env is active in this shell (in a new shell, activate it first: source $_toymlx_env/bin/activate)" >&2
  fi
else
  echo "toymlx: installed into $_toymlx_env; to use it in this shell: source $_toymlx_env/bin/activate (or set up with: source scripts/install.sh)" >&2
fi
unset _toymlx_here _toymlx_sourced _toymlx_env
if [ "$_toymlx_rc" -eq 0 ]; then unset _toymlx_rc; true; else unset _toymlx_rc; false; fi
