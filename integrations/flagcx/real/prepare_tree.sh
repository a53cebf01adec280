#!/usr/bin/env bash
# Makes the FlagCX source tree that build_real.sh takes to a machine without network:
# FlagCX at 0c721293 without its docs and packaging, with the nlohmann json headers its
# utils.h includes put where its Makefile looks (third-party/json/single_include), since that
# submodule is empty in a plain clone or archive.
#
#   bash prepare_tree.sh SOURCE DEST
#
# SOURCE: a FlagCX git repository (bare or not; 0c721293 is taken with git archive) or a plain
#   tree at that commit (also one inside another repository's work tree, or one made by this
#   script, whose json headers are kept). DEST: a new folder (it must not exist).
# The json headers come from FLAGCX_JSON_INCLUDE (a folder holding nlohmann/json.hpp), else the
# system's (Debian: nlohmann-json3-dev), else the nlohmann-json PyPI package of $PYTHON.
set -euo pipefail
COMMIT=0c721293a79348323afc874d7067b4fce0b06643
SRC=${1:?usage: prepare_tree.sh SOURCE DEST}
DEST=${2:?usage: prepare_tree.sh SOURCE DEST}
PY=${PYTHON:-python3}
die() { echo "prepare_tree.sh: $*" >&2; exit 1; }

own_repo() {  # is SRC itself a git repository (bare, or its work tree's top), not a folder inside one?
  [ "$(git -C "$SRC" rev-parse --is-bare-repository 2>/dev/null)" = true ] && return 0
  local top
  top=$(git -C "$SRC" rev-parse --show-toplevel 2>/dev/null) || return 1
  [ "$(cd "$top" && pwd -P)" = "$(cd "$SRC" && pwd -P)" ]
}

[ ! -e "$DEST" ] || die "$DEST exists: give a new folder"
mkdir -p "$DEST"
if own_repo; then
  git -C "$SRC" cat-file -e "$COMMIT^{commit}" 2>/dev/null || die "$SRC has no commit $COMMIT"
  git -C "$SRC" archive "$COMMIT" | tar -x -C "$DEST"
else
  [ -f "$SRC/flagcx/flagcx.cc" ] || die "$SRC is neither a git repository nor a FlagCX tree"
  cp -r "$SRC/." "$DEST/"
fi
rm -rf "$DEST/docs" "$DEST/.github" "$DEST/docker" "$DEST/packaging" "$DEST/.git"

json_dir() {  # a folder holding nlohmann/json.hpp
  local d
  for d in "${FLAGCX_JSON_INCLUDE:-}" /usr/include /usr/local/include; do
    [ -n "$d" ] && [ -f "$d/nlohmann/json.hpp" ] && { echo "$d"; return 0; }
  done
  d=$($PY -c 'import importlib.util as u; s = u.find_spec("nlohmann_json"); print(list(s.submodule_search_locations)[0])' 2>/dev/null) \
    && [ -f "$d/include/nlohmann/json.hpp" ] && { echo "$d/include"; return 0; }
  return 1
}
if [ -f "$DEST/third-party/json/single_include/nlohmann/json.hpp" ]; then  # a tree prepared before
  echo "$DEST: FlagCX $COMMIT, json headers as the source had them; $(du -sh "$DEST" | cut -f1), $(find "$DEST" -type f | wc -l) files"
  exit 0
fi
JSON=$(json_dir) || die "no nlohmann/json.hpp: apt-get install nlohmann-json3-dev, or pip install nlohmann-json, or set FLAGCX_JSON_INCLUDE"
mkdir -p "$DEST/third-party/json/single_include"
cp -r "$JSON/nlohmann" "$DEST/third-party/json/single_include/"
echo "$DEST: FlagCX $COMMIT, json headers from $JSON; $(du -sh "$DEST" | cut -f1), $(find "$DEST" -type f | wc -l) files"
