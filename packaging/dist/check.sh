#!/usr/bin/env bash
# The packaged build as a new user meets it (docs/packaging.md): unpacked into an empty
# folder, run with an empty home and a bare PATH (no Python, compiler or repository in
# reach), it answers from the CLI, its window opens under Xvfb and answers a message, and
# each CPU library it ships that this processor runs is checked exact (tandem check-cpu).
# Needs Xvfb, xdotool and ImageMagick's import (Debian: xvfb xdotool imagemagick).
#   packaging/dist/check.sh [ARCHIVE] [SIZE]   (defaults: dist/tandem-linux-x86_64.tar.gz,
#   1366x768); screenshots land in dist/check/.
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=$(realpath "${1:-dist/tandem-linux-x86_64.tar.gz}")
SIZE=${2:-1366x768}
SHOTS=$PWD/dist/check
mkdir -p "$SHOTS"
BOX=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$BOX"' EXIT
mkdir "$BOX/home" "$BOX/app"
t0=$(date +%s.%N)
tar -xzf "$ARCHIVE" -C "$BOX/app"
bare() { env -i HOME="$BOX/home" PATH=/usr/bin:/bin LANG=C.UTF-8 "$@"; }

echo "== tandem generate, empty home, bare PATH"
bare "$BOX/app/tandem/tandem" generate --prompt "Name three colours." --max-tokens 24
t1=$(date +%s.%N)
echo "unpack to first answer: $(python3 -c "print(round($t1 - $t0, 1))") s"

echo "== the window under Xvfb at $SIZE"
Xvfb :77 -screen 0 "${SIZE}x24" -nolisten tcp &
sleep 2
bare DISPLAY=:77 "$BOX/app/tandem/tandem" > "$BOX/gui.log" 2>&1 &
win=""
for _ in $(seq 1 90); do
    win=$(DISPLAY=:77 xdotool search --onlyvisible --name "Tandem" 2>/dev/null | head -1) || true
    [ -n "$win" ] && break
    sleep 1
done
[ -n "$win" ] || { echo "no window"; cat "$BOX/gui.log"; exit 1; }
sleep 8  # the engine loads in its own process
DISPLAY=:77 xdotool getwindowgeometry "$win"
DISPLAY=:77 import -window root "$SHOTS/start-$SIZE.png"
# No window manager under Xvfb: focus the window, then click into the message box (the
# bottom of the window, left of Send) as a user would.
eval "$(DISPLAY=:77 xdotool getwindowgeometry --shell "$win")"
DISPLAY=:77 xdotool windowfocus --sync "$win"
DISPLAY=:77 xdotool mousemove --window "$win" $((WIDTH / 2)) $((HEIGHT - 45)) click 1
DISPLAY=:77 xdotool type --delay 20 "Say hello in five words."
DISPLAY=:77 xdotool key Return
DB="$BOX/home/.local/share/tandem/conversations.sqlite3"
answer=""
for _ in $(seq 1 90); do
    answer=$(python3 - "$DB" <<'PY' 2>/dev/null || true
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute(
    "SELECT content FROM messages WHERE role='assistant' AND status='complete'").fetchall()
print(rows[-1][0] if rows else "")
PY
)
    [ -n "$answer" ] && break
    sleep 1
done
DISPLAY=:77 import -window root "$SHOTS/answer-$SIZE.png"
[ -n "$answer" ] || { echo "no answer in the window"; tail -20 "$BOX/gui.log"; exit 1; }
echo "the window answered: $answer"
echo "CPU library ggml chose: $(cat /proc/[0-9]*/maps 2>/dev/null | grep -o 'libggml-cpu-[a-z0-9_]*' | sort -u | tr '\n' ' ')"
echo "screenshots: $SHOTS/start-$SIZE.png $SHOTS/answer-$SIZE.png"

# Most laptops run a lower level than the machine that built the bundle (AVX2: Intel
# 12th generation and later, AMD Zen 2/3): each CPU library this processor can run is
# loaded in turn and checked exact (about 2 minutes a level on 2 cores).
echo "== tandem check-cpu: each CPU library of the bundle that this CPU runs"
bare "$BOX/app/tandem/tandem" check-cpu --json "$SHOTS/check-cpu.json"
