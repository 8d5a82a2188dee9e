#!/bin/sh
# Adds Tandem to the desktop's application menu (this folder's `tandem`, its icon).
# Remove with: rm ~/.local/share/applications/tandem.desktop
set -e
here=$(cd "$(dirname "$0")" && pwd)
apps=${XDG_DATA_HOME:-$HOME/.local/share}/applications
mkdir -p "$apps"
sed -e "s|^Exec=.*|Exec=\"$here/tandem\"|" -e "s|^Icon=.*|Icon=$here/tandem.svg|" \
    -e "s|^Terminal=.*|Terminal=false|" "$here/tandem.desktop" > "$apps/tandem.desktop"
echo "Tandem added to the application menu ($apps/tandem.desktop)"
