#!/usr/bin/env bash
# coqui-tts decodes audio through torchcodec, which loads FFmpeg's shared libraries at run time.
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q 'libavutil\.so'; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "FFmpeg shared libraries are missing: installing them with apt-get (needed to decode audio)."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ffmpeg >/dev/null
  exit 0
fi
echo "FFmpeg shared libraries (libavutil, libavcodec, ...) are missing, and this script can only" >&2
echo "install them as root with apt-get. Install FFmpeg yourself (Debian/Ubuntu: sudo apt-get install" >&2
echo "ffmpeg; macOS: brew install ffmpeg; conda: conda install ffmpeg), then run the command again." >&2
exit 1
