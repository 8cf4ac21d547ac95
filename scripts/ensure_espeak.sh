#!/usr/bin/env bash
# The speech-shaped benchmark (benchmarks/bench_speech_language.py) speaks its English and
# Amharic text with espeak-ng, a Debian package with both voices.
set -euo pipefail
if command -v espeak-ng >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "espeak-ng is missing: installing it with apt-get (the speech benchmark speaks with it)."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null
  exit 0
fi
echo "espeak-ng is missing, and this script can only install it as root with apt-get. Install" >&2
echo "it yourself (Debian/Ubuntu: sudo apt-get install espeak-ng; macOS: brew install espeak-ng)," >&2
echo "then run the command again." >&2
exit 1
