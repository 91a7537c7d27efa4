#!/usr/bin/env bash
# Install kvtierd as a systemd service. Run as root from anywhere:
#
#   systemd/install.sh [--kvtierd PATH] [--add-user USER]... [--enable-now] [--root DIR]
#
# What it does, in order (every step is safe to repeat):
#   1. copies kvtier.service  -> /etc/systemd/system/kvtier.service
#             kvtier.sysusers.conf -> /etc/sysusers.d/kvtier.conf
#             kvtier.tmpfiles.conf -> /etc/tmpfiles.d/kvtier.conf
#   2. creates user and group kvtier (systemd-sysusers)
#   3. creates /run/kvtier and /var/lib/kvtier, the state directory where the
#      default L3 backend keeps its disk store (/var/lib/kvtier/l3), with
#      systemd-tmpfiles --create (an existing /var/lib/kvtier is set to mode 0700)
#   4. copies kvtierd.toml.example -> /etc/kvtier/kvtierd.toml, only if that file
#      does not exist yet (an existing configuration is never touched)
#   5. with --kvtierd PATH: writes the drop-in
#      /etc/systemd/system/kvtier.service.d/10-kvtierd-path.conf that points
#      ExecStart at PATH (a virtualenv install, say)
#   6. with --add-user USER: adds USER (an engine's user) to group kvtier
#   7. systemctl daemon-reload
# It starts nothing unless --enable-now is given.
#
# --root DIR installs into DIR instead of / (to stage an image or to test this
# script); systemctl is then not called and --enable-now is refused.

set -euo pipefail

readonly UNIT_NAME=kvtier.service
readonly DEFAULT_KVTIERD=/usr/local/bin/kvtierd
readonly CONFIG_PATH=/etc/kvtier/kvtierd.toml

SRC_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
ROOT=""
KVTIERD=""
ENABLE_NOW=0
ADD_USERS=()

usage() {
    sed -n '2,24s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
}

die() {
    echo "install.sh: error: $*" >&2
    exit 1
}

warn() {
    echo "install.sh: warning: $*" >&2
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --enable-now) ENABLE_NOW=1 ;;
        --kvtierd) [[ $# -ge 2 ]] || die "--kvtierd needs a path"; KVTIERD=$2; shift ;;
        --kvtierd=*) KVTIERD=${1#*=} ;;
        --add-user) [[ $# -ge 2 ]] || die "--add-user needs a user name"; ADD_USERS+=("$2"); shift ;;
        --add-user=*) ADD_USERS+=("${1#*=}") ;;
        --root) [[ $# -ge 2 ]] || die "--root needs a directory"; ROOT=$2; shift ;;
        --root=*) ROOT=${1#*=} ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done

if [[ -n $ROOT ]]; then
    [[ -d $ROOT ]] || die "--root '$ROOT' is not a directory"
    ROOT=$(cd -- "$ROOT" && pwd)
    [[ $ROOT == / ]] && ROOT=""
fi
if [[ -n $ROOT && $ENABLE_NOW -eq 1 ]]; then
    die "--enable-now cannot be used with --root"
fi
[[ $(id -u) -eq 0 ]] || die "run as root (it writes under /etc and creates a system user)"

for tool in systemd-sysusers systemd-tmpfiles install; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found (is systemd installed?)"
done
for f in kvtier.service kvtier.sysusers.conf kvtier.tmpfiles.conf kvtierd.toml.example; do
    [[ -f $SRC_DIR/$f ]] || die "missing $SRC_DIR/$f"
done

# install_file SRC DEST MODE: copy SRC to DEST and report whether anything changed.
install_file() {
    local src=$1 dest=$2 mode=$3
    if [[ -f $dest ]] && cmp -s -- "$src" "$dest"; then
        echo "unchanged  $dest"
    else
        local verb=created
        [[ -e $dest ]] && verb=updated
        install -D -m "$mode" -- "$src" "$dest"
        echo "$verb    $dest"
    fi
}

# 1. Unit, sysusers and tmpfiles entries.
install_file "$SRC_DIR/kvtier.service" "$ROOT/etc/systemd/system/$UNIT_NAME" 0644
install_file "$SRC_DIR/kvtier.sysusers.conf" "$ROOT/etc/sysusers.d/kvtier.conf" 0644
install_file "$SRC_DIR/kvtier.tmpfiles.conf" "$ROOT/etc/tmpfiles.d/kvtier.conf" 0644

# 2-3. User, group and directories. Both tools only add what is missing.
if [[ -n $ROOT ]]; then
    mkdir -p -- "$ROOT/etc"
    systemd-sysusers --root="$ROOT" "$ROOT/etc/sysusers.d/kvtier.conf"
    systemd-tmpfiles --root="$ROOT" --create "$ROOT/etc/tmpfiles.d/kvtier.conf"
else
    systemd-sysusers /etc/sysusers.d/kvtier.conf
    systemd-tmpfiles --create /etc/tmpfiles.d/kvtier.conf
fi

# 4. Configuration: root-owned (the daemon cannot rewrite it), readable by group
# kvtier. Engine users in that group can read it too: keep secrets (backend
# passwords) in a separate file referenced with @file and mode 0600 kvtier.
config_dest=$ROOT$CONFIG_PATH
install -d -m 0755 -- "$(dirname -- "$config_dest")"
if [[ -e $config_dest ]]; then
    echo "kept       $config_dest (exists; compare with $SRC_DIR/kvtierd.toml.example)"
else
    # Under --root the group is looked up in that root's /etc/group, not the host's.
    if [[ -n $ROOT ]]; then
        config_group=$(awk -F: '$1 == "kvtier" { print $3 }' "$ROOT/etc/group")
    else
        config_group=kvtier
    fi
    install -m 0640 -o root -g "$config_group" -- "$SRC_DIR/kvtierd.toml.example" "$config_dest"
    echo "created    $config_dest (from kvtierd.toml.example: edit before starting)"
fi

# 5. Where kvtierd lives, when it is not /usr/local/bin/kvtierd.
dropin_dir=$ROOT/etc/systemd/system/$UNIT_NAME.d
dropin=$dropin_dir/10-kvtierd-path.conf
if [[ -n $KVTIERD ]]; then
    [[ $KVTIERD == /* ]] || die "--kvtierd must be an absolute path, got '$KVTIERD'"
    # Characters systemd would read as quotes, specifiers (%) or variables ($) are refused.
    [[ $KVTIERD =~ ^[A-Za-z0-9._/+@-]+$ ]] || die "--kvtierd path has characters a unit file cannot hold as is: '$KVTIERD'"
    [[ -x $ROOT$KVTIERD && ! -d $ROOT$KVTIERD ]] || die "--kvtierd '$ROOT$KVTIERD' is not an executable file"
    # The interpreter kvtierd runs (its #! line), followed through symlinks inside ROOT: a
    # venv made from a pyenv or uv Python links to an interpreter under a home directory
    # wherever the venv itself lives.
    interp=""
    if IFS= read -r first <"$ROOT$KVTIERD" && [[ $first == '#!'* ]]; then
        interp=${first#\#!}
        interp=${interp#"${interp%%[! ]*}"}
        interp=${interp%% *}
        hops=0
        while [[ $interp == /* && -L $ROOT$interp && $hops -lt 40 ]]; do
            target=$(readlink -- "$ROOT$interp")
            [[ $target == /* ]] || target=$(dirname -- "$interp")/$target
            interp=$(realpath -m -s -- "$target")
            hops=$((hops + 1))
        done
    fi
    home_path=""
    tmp_path=""
    for p in "$KVTIERD" "$interp"; do
        case "$p" in /home/* | /root/*) home_path=$p ;; /tmp/* | /var/tmp/*) tmp_path=$p ;; esac
    done
    tmp=$(mktemp)
    trap 'rm -f -- "$tmp"' EXIT
    {
        echo "# Written by systemd/install.sh --kvtierd; re-run it to change the path."
        echo "[Service]"
        echo "ExecStart="
        echo "ExecStart=$KVTIERD --config $CONFIG_PATH"
        if [[ -n $home_path ]]; then
            echo "# kvtierd or its interpreter ($home_path) lives under a home directory:"
            echo "# read-only instead of hidden."
            echo "ProtectHome=read-only"
        fi
        if [[ -n $tmp_path ]]; then
            echo "# kvtierd or its interpreter ($tmp_path) lives in a temporary directory,"
            echo "# which the unit's PrivateTmp=yes would hide: the host's /tmp instead."
            echo "PrivateTmp=no"
        fi
    } >"$tmp"
    install_file "$tmp" "$dropin" 0644
    if [[ -n $home_path ]]; then
        warn "user kvtier must be able to read and execute $home_path and its Python environment (check the home directory's mode)"
    fi
    if [[ -n $tmp_path ]]; then
        warn "$tmp_path is in a temporary directory (cleaned at boot, PrivateTmp=no written for it): install kvtier somewhere lasting, such as /opt"
    fi
elif [[ -f $dropin ]]; then
    echo "kept       $dropin (ExecStart from an earlier --kvtierd)"
elif [[ ! -x $ROOT$DEFAULT_KVTIERD ]]; then
    found=$(command -v kvtierd 2>/dev/null || true)
    warn "$DEFAULT_KVTIERD not found; the service will fail to start until it exists."
    if [[ -n $found ]]; then
        warn "re-run with: --kvtierd $found"
    else
        warn "install kvtier (pip install kvtier) or re-run with --kvtierd PATH"
    fi
fi

# 6. Engine users join group kvtier (already a member: nothing changes).
for user in ${ADD_USERS[@]+"${ADD_USERS[@]}"}; do
    if [[ -n $ROOT ]]; then
        warn "--add-user $user skipped under --root (add it with an 'm $user kvtier' sysusers line)"
        continue
    fi
    id -- "$user" >/dev/null 2>&1 || die "--add-user: no such user '$user'"
    if id -nG -- "$user" | tr ' ' '\n' | grep -qx kvtier; then
        echo "unchanged  $user is in group kvtier"
    else
        usermod -a -G kvtier -- "$user"
        echo "added      $user to group kvtier (takes effect at the user's next login)"
    fi
done

# 7. Tell systemd, when it is the running service manager.
if [[ -n $ROOT ]]; then
    echo "staged under $ROOT; systemctl not called"
    exit 0
fi
if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null 2>&1; then
    systemctl daemon-reload
    echo "reloaded   systemd units"
else
    warn "systemd is not the running service manager here; skipped systemctl daemon-reload"
    if [[ $ENABLE_NOW -eq 1 ]]; then
        die "--enable-now needs a running systemd"
    fi
fi

if [[ $ENABLE_NOW -eq 1 ]]; then
    systemctl enable --now "$UNIT_NAME"
    echo "enabled and started $UNIT_NAME"
else
    cat <<EOF

Installed. Edit $CONFIG_PATH, then start kvtierd now and at every boot with:
    systemctl enable --now $UNIT_NAME
Add engine users to group kvtier:  usermod -aG kvtier USER
Follow its log:                    journalctl -u $UNIT_NAME -f
L3 (the default "file" backend) is kept on disk in /var/lib/kvtier/l3, up to 16 GiB;
set hicache_storage_backend_extra_config in $CONFIG_PATH to size or move it.
EOF
fi
