# Sourced by bench/convert.sh and bench/manifest.sh: their shared command line
# and the synthetic ZeRO-2 checkpoint (bench/convert_gen) both time. Set
# PARAMS, DIR and USAGE before sourcing; afterwards PARAMS, DP, RUNS, KEEP,
# UCKPT, GEN, DIR are set, IN (DIR/global_step1) exists and is in the page
# cache, and DIR is removed at exit unless --keep.
DP=4 RUNS=3 BUILD=build KEEP=0 UCKPT= GEN=
while [ $# -gt 0 ]; do
  case $1 in
    --params) PARAMS=$2; shift 2 ;;
    --dp) DP=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --build) BUILD=$2; shift 2 ;;
    --uckpt) UCKPT=$2; shift 2 ;;
    --gen) GEN=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) echo "$USAGE"; exit 0 ;;
    *) echo "unknown argument $1" >&2; echo "$USAGE" >&2; exit 2 ;;
  esac
done
UCKPT=${UCKPT:-$BUILD/src/cli/uckpt} GEN=${GEN:-$BUILD/bench/convert_gen}
for b in "$UCKPT" "$GEN"; do [ -x "$b" ] || { echo "missing $b (build first: cmake --build $BUILD)" >&2; exit 2; }; done
mkdir -p "$DIR"
[ $KEEP = 1 ] || trap 'rm -rf "$DIR"' EXIT
IN=$DIR/global_step1
# The generated checkpoint is kept between runs of the same size (with --keep).
if [ ! -e "$IN/.params-$PARAMS-dp$DP" ]; then
  rm -rf "$IN"
  "$GEN" --params "$PARAMS" --dp "$DP" "$IN"
  touch "$IN/.params-$PARAMS-dp$DP"
fi
cat "$IN"/*.pt > /dev/null  # warm the page cache
