#!/usr/bin/env bash
# Writes the manual pages from what the programs and the annotated configuration say, so that
# they never drift from them:
#   moecached.8        moecached --help, and what the daemon is for
#   moecachectl.1      moecachectl --help and 'moecachectl help COMMAND' for every command
#   moecached.toml.5   config/moecached.toml: its opening comment, each [section] and each key
#                      with its default and the comment above it
# Usage: make-man.sh OUT_DIR MOECACHED MOECACHECTL CONFIG_TOML VERSION
set -euo pipefail
out=${1:?usage: make-man.sh OUT_DIR MOECACHED MOECACHECTL CONFIG_TOML VERSION}
daemon=${2:?}; ctl=${3:?}; toml=${4:?}; version=${5:?}
mkdir -p "$out"
date=$(date -u -d "@${SOURCE_DATE_EPOCH:-$(stat -c %Y "$toml")}" +%Y-%m-%d)

# roff-safe text: backslashes doubled, a leading dot or quote escaped, hyphens in options kept.
esc() { sed -e 's/\\/\\e/g' -e "s/^\\([.']\\)/\\\\\\&\\1/" -e 's/-/\\-/g'; }

{
  echo ".TH MOECACHED 8 \"$date\" \"moecache $version\" \"System Administration\""
  echo ".SH NAME"
  echo "moecached \\- keeps the hot experts of Mixture-of-Experts models in RAM and VRAM"
  echo ".SH SYNOPSIS"
  echo ".B moecached"
  echo "[\\-\\-config FILE] [\\-\\-check] [\\-\\-verbose] [\\-\\-version]"
  echo ".SH DESCRIPTION"
  echo ".nf"
  "$daemon" --help | tail -n +3 | esc
  echo ".fi"
  cat <<'ROFF'
.SH SIGNALS
.TP
.B SIGHUP
reload the configuration (settings that need a restart are named in the log)
.TP
.BR SIGTERM ", " SIGINT
save every model's heat profile, unlock, and exit
.SH FILES
.TP
.I /etc/moecache/moecached.toml
the configuration, and drop-ins in
.I /etc/moecache/moecached.toml.d/
(see
.BR moecached.toml (5))
.TP
.I /var/lib/moecache/profiles/
heat profiles: which experts were hot, for a warm start
.TP
.I /run/moecache/moecached.sock
the client socket (libmoecache-client, the CUDA hook)
.SH SEE ALSO
.BR moecachectl (1),
.BR moecached.toml (5),
.BR systemd.service (5)
ROFF
} > "$out/moecached.8"

{
  echo ".TH MOECACHECTL 1 \"$date\" \"moecache $version\" \"User Commands\""
  echo ".SH NAME"
  echo "moecachectl \\- control and observe moecached over D\\-Bus"
  echo ".SH SYNOPSIS"
  echo ".B moecachectl"
  echo "[\\-\\-json] [\\-\\-bus BUS] COMMAND [ARGS]"
  echo ".SH DESCRIPTION"
  echo ".nf"
  "$ctl" --help | tail -n +3 | esc
  echo ".fi"
  echo ".SH COMMANDS"
  for cmd in $("$ctl" --help | awk '/^Commands:/ {on = 1; next} on && /^  [a-z]/ {print $1} on && /^$/ {exit}'); do
    [ "$cmd" = help ] && continue
    echo ".SS $cmd"
    echo ".nf"
    "$ctl" help "$cmd" | esc
    echo ".fi"
  done
  cat <<'ROFF'
.SH SEE ALSO
.BR moecached (8),
.BR moecached.toml (5)
ROFF
} > "$out/moecachectl.1"

{
  echo ".TH MOECACHED.TOML 5 \"$date\" \"moecache $version\" \"File Formats\""
  echo ".SH NAME"
  echo "moecached.toml \\- configuration of moecached"
  echo ".SH DESCRIPTION"
  # The opening comment: paragraphs until the first [section].
  awk '/^\[/ {exit} /^# ?/ {sub(/^# ?/, ""); print; next} /^$/ {print ""}' "$toml" |
    esc | awk 'BEGIN {print ".nf"} {print} END {print ".fi"}'
  # Each section, each "#key = default" with the comment lines above it.
  awk '
    function flush() { text = "" }
    !started && !/^\[/ { next }  # the opening comment: above
    { started = 1 }
    /^\[\[model\]\]|^# Models:/ { models = 1 }
    /^\[/ && !models { print ".SH [" substr($0, 2, length($0) - 2) "]"; flush(); next }
    models { sub(/^# ?/, ""); modeltext = modeltext $0 "\n"; next }
    /^# / { sub(/^# /, ""); text = text $0 "\n"; next }
    /^#$/ { text = text "\n"; next }
    /^#[A-Za-z_]+ = / {
      line = substr($0, 2)
      gsub(/"/, "\001", line)  # a quote: \(dq once the text is escaped
      print ".TP"; print ".B " line
      printf "%s", text; flush(); next
    }
    /^$/ { if (text != "") { print ".PP"; printf "%s", text; flush() } }
    END { print ".SH MODELS"; print ".nf"; printf "%s", modeltext; print ".fi" }
  ' "$toml" | sed -e 's/\\/\\e/g' -e '/^\.\(TP\|B \|SH\|PP\|nf\|fi\)/!s/^\([.'"'"']\)/\\\&\1/' -e 's/\x01/\\(dq/g'
  cat <<'ROFF'
.SH FILES
.I /etc/moecache/moecached.toml
and
.IR /etc/moecache/moecached.toml.d/*.toml ,
read in name order; later files override single keys, [[model]] tables add up.
.SH SEE ALSO
.BR moecached (8),
.BR moecachectl (1)
ROFF
} > "$out/moecached.toml.5"
