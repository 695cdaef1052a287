#!/usr/bin/env bash
# The GGUF converter the tests use as the reference writer of GGUF files: llama.cpp's convert_hf_to_gguf.py (with
# its conversion/ package and gguf-py), taken from the llama-cpp-python source release on PyPI (the project's pinned
# peer) and kept in .venv/share/llama.cpp. Only Python files: nothing is built. Run once by `scripts/setup.sh test`.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${NEXTTOKEN_LLAMA_CPP_PYTHON:-0.3.36}"
dest=".venv/share/llama.cpp"
if [ -f "$dest/convert_hf_to_gguf.py" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "setup: fetching llama.cpp's GGUF converter (llama-cpp-python $VERSION source, PyPI)"
.venv/bin/python -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
src="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp" "$src/convert_hf_to_gguf.py" "$src/conversion" \
  "$src/gguf-py" "$src/models/templates" "$src/LICENSE"
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$tmp/$src" "$dest"
echo "$VERSION" > "$dest/VERSION"
echo "setup: llama.cpp converter in $dest"
