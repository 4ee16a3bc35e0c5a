#!/usr/bin/env bash
# Unprivileged sshd for DeepSpeed's multi-node pdsh launcher, run in the container on every node:
#
#   docker run -d --gpus all --network host --ipc host -v ~/.ssh/megatron_lite:/home/trainer/.ssh:ro ... \
#       IMAGE docker/sshd.sh
#
# It listens on $SSH_PORT (2222; no root needed above 1024; $SSH_LISTEN_ADDRESS narrows the interfaces),
# accepts only the keys in ~/.ssh/authorized_keys, and hands the container's environment (PATH to the image's python and ninja,
# CUDA_HOME, HF_HOME, WANDB_*, NCCL_*, ...) to every ssh session through SetEnv, so the commands pdsh
# starts see the same environment as `docker exec`. Host keys and the generated config live in
# $SSHD_STATE (default ~/.sshd), outside ~/.ssh so that ~/.ssh can be mounted read-only.
set -euo pipefail

port="${SSH_PORT:-2222}"
state="${SSHD_STATE:-${HOME}/.sshd}"
mkdir -p "${state}"
chmod 700 "${state}"
if [[ ! -f "${state}/ssh_host_ed25519_key" ]]; then
    ssh-keygen -q -t ed25519 -N "" -f "${state}/ssh_host_ed25519_key"
fi
if [[ ! -f "${HOME}/.ssh/authorized_keys" ]]; then
    echo "sshd.sh: ${HOME}/.ssh/authorized_keys is missing: mount a directory holding the launcher's public key" >&2
    exit 1
fi

# Variables handed to ssh sessions (sshd otherwise starts them with a minimal PATH and nothing else).
forward=()
while IFS='=' read -r name _; do
    case "${name}" in
        PATH | LD_LIBRARY_PATH | CUDA_HOME | PYTHONPATH | HF_HOME | TRITON_CACHE_DIR | TORCH_EXTENSIONS_DIR | \
        NVIDIA_* | CUDA_* | NCCL_* | WANDB_* | MASTER_* | OMP_NUM_THREADS)
            value="${!name}"
            forward+=("${name}=\"${value//\"/\\\"}\"")
            ;;
    esac
done < <(env)

config="${state}/sshd_config"
umask 077
{
    echo "Port ${port}"
    if [[ -n "${SSH_LISTEN_ADDRESS:-}" ]]; then  # default: every interface (the other nodes must reach it)
        echo "ListenAddress ${SSH_LISTEN_ADDRESS}"
    fi
    echo "HostKey ${state}/ssh_host_ed25519_key"
    echo "PidFile ${state}/sshd.pid"
    echo "AuthorizedKeysFile ${HOME}/.ssh/authorized_keys"
    echo "AllowUsers $(id -un)"
    echo "PasswordAuthentication no"
    echo "KbdInteractiveAuthentication no"
    echo "PubkeyAuthentication yes"
    echo "UsePAM no"
    echo "PermitRootLogin no"
    echo "X11Forwarding no"
    echo "PrintMotd no"
    if ((${#forward[@]})); then
        echo "SetEnv ${forward[*]}"
    fi
} > "${config}"

/usr/sbin/sshd -t -f "${config}"
echo "sshd.sh: listening on port ${port} as $(id -un)" >&2
exec /usr/sbin/sshd -D -e -f "${config}"
