# Shared by scripts/demo.sh, scripts/demo-gpu.sh and tests/demo: runs training
# jobs and compares loss curves (metrics.csv) against the demo's tolerances.
# Source it; set UCKPT (the binary) first.

# compare_losses BASE_CSV RUN_CSV FIRST LAST MODE
#   MODE: exact       every step bit-identical (the logged float64 text)
#         universal   first step within 1e-6 relative, later steps 1e-3 absolute
#         changed:R:A first step within R relative, later steps A absolute
#         rel:TOL     every step within TOL relative
# Prints "FIRST-LAST MAX_ABS_DELTA TOLERANCE PASS|FAIL [why]"; returns 1 on FAIL.
# A step missing from either file is a FAIL.
compare_losses() {
  local base=$1 run=$2 first=$3 last=$4 mode=$5
  awk -F, -v first="$first" -v last="$last" -v mode="$mode" '
    FNR == 1 { next }                          # header
    NR == FNR { base[$1] = $2; next }
    { run[$1] = $2 }
    END {
      if (mode == "exact") tol = "bit-identical"
      if (mode == "universal") mode = "changed:1e-6:1e-3"
      if (mode ~ /^changed:/) {
        split(mode, part, ":"); first_rel = part[2] + 0; later_abs = part[3] + 0
        tol = "1st rel " part[2] ", then abs " part[3]; mode = "changed"
      }
      else if (mode ~ /^rel:/) { rel = substr(mode, 5) + 0; tol = "rel " substr(mode, 5) }
      if (tol == "") { print "unknown mode " mode; exit 2 }
      max = 0; ok = 1; why = ""
      for (s = first; s <= last; s++) {
        if (!(s in base) || !(s in run)) { ok = 0; why = "step " s " missing"; continue }
        b = base[s] + 0; r = run[s] + 0; d = r - b; if (d < 0) d = -d
        if (d > max) max = d
        ab = b < 0 ? -b : b
        if (mode == "exact") pass = (r == b)
        else if (mode == "changed") pass = (s == first) ? (d <= first_rel * ab) : (d <= later_abs)
        else pass = (d <= rel * ab)
        if (!pass && why == "") { ok = 0; why = "step " s ": " base[s] " vs " run[s] }
      }
      printf "%d-%d %.3g %s %s%s\n", first, last, max, tol, ok ? "PASS" : "FAIL", why == "" ? "" : " (" why ")"
      exit ok ? 0 : 1
    }' "$base" "$run"
}

# The comparison table: add_row NAME EXPECT BASE_CSV RUN_CSV FIRST LAST MODE
# EXPECT is "pass" or "fail" (a negative control: its comparison must FAIL for
# the row to PASS). print_table prints the rows; demo_failures counts failures.
demo_rows=()
demo_failures=0
add_row() {
  local name=$1 expect=$2 line verdict
  line=$(compare_losses "$3" "$4" "$5" "$6" "$7") || true
  read -r steps delta rest <<<"$line"
  local tolerance=${rest% PASS*}; tolerance=${tolerance% FAIL*}
  local got=PASS; [[ $rest == *" FAIL"* || $rest == FAIL* ]] && got=FAIL
  if [ "$expect" = fail ]; then
    if [ $got = FAIL ]; then verdict="PASS (departs, as expected)"; else verdict="FAIL (negative control not detected)"; fi
  else
    verdict=$got
    [ $got = FAIL ] && verdict="FAIL ${rest#*FAIL}"
  fi
  [[ $verdict == FAIL* ]] && demo_failures=$((demo_failures + 1))
  demo_rows+=("$name|$steps|$delta|$tolerance|$verdict")
}
# The demo's six rows, from the runs' metrics.csv under LOGS: add_demo_rows LOGS
# GA_BATCH GA_MICRO (experiment 2's sizes); uses MID, STEPS and TOL_SAME /
# TOL_GA / TOL_CHANGED.
add_demo_rows() {
  local logs=$1 b=$2 m=$3 first=$((MID + 1))
  local base=$logs/baseline_4ranks/metrics.csv ga=$logs/ga_1rank_micro${b}_ga1/metrics.csv
  add_row "1  resume ZeRO, 4 -> 4 ranks" pass "$base" "$logs/resume_zero_4ranks/metrics.csv" $first "$STEPS" "$TOL_SAME"
  add_row "1  resume universal, 4 -> 4 ranks" pass "$base" "$logs/resume_universal_4ranks/metrics.csv" $first "$STEPS" "$TOL_SAME"
  add_row "2  1 rank micro $m GA 4 vs micro $b GA 1" pass "$ga" "$logs/ga_1rank_micro${m}_ga4/metrics.csv" 1 "$STEPS" "$TOL_GA"
  add_row "2  2 ranks micro $m GA 2 vs 1 rank micro $b" pass "$ga" "$logs/ga_2ranks_micro${m}_ga2/metrics.csv" 1 "$STEPS" "$TOL_GA"
  add_row "3  resume universal, 4 -> 2 ranks (GA 2)" pass "$base" "$logs/resume_universal_2ranks/metrics.csv" $first "$STEPS" "$TOL_CHANGED"
  add_row "-  control: 4 -> 2 without optimizer state" fail "$base" "$logs/no_optimizer_states_2ranks/metrics.csv" $first "$STEPS" "$TOL_CHANGED"
}
print_table() {
  printf '%-44s %-8s %-11s %-28s %s\n' comparison steps 'max|dloss|' tolerance result
  printf '%-44s %-8s %-11s %-28s %s\n' ---------- ----- ---------- --------- ------
  local row
  for row in "${demo_rows[@]}"; do
    IFS='|' read -r a b c d e <<<"$row"
    printf '%-44s %-8s %-11s %-28s %s\n' "$a" "$b" "$c" "$d" "$e"
  done
}

# copy_checkpoint FROM_DIR TAG TO_DIR: a fresh checkpoint folder holding one tag
# (and its `latest` / `latest_universal`), so a resumed run never writes into
# the baseline's folder.
copy_checkpoint() {
  local from=$1 tag=$2 to=$3
  rm -rf "$to"; mkdir -p "$to"
  cp -r "$from/$tag" "$to/"
  if [[ $tag == *universal* ]]; then echo -n "$tag" >"$to/latest_universal"; else echo -n "$tag" >"$to/latest"; fi
}
