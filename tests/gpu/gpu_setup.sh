# Sourced by the GPU run scripts (from the project root), with the default install folder as its argument:
# logs go to $OUT (default ./gpu-out), Python output is unbuffered, and maingrad is installed once into $MG.
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MG=${MG:-$1}
if [ ! -d "$MG/maingrad/hooks" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$MG" . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
fi
