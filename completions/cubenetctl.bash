# bash completion for cubenetctl(1)                        -*- shell-script -*-
#
# Install as /usr/share/bash-completion/completions/cubenetctl (or source it).
# Self-contained: works with or without the bash-completion package.
# Completes commands, global options, the options of ensure, top and
# flows, option values
# (--json=, --bus=, --varlink=) and sandbox ids, which it reads from
# `cubenetctl list --no-legend -q` (first column) on the bus given on the
# command line or in $CUBENETCTL_BUS; if that fails, no ids are offered.

_cubenetctl_commands='list status ensure egress-rules egress-ca release reconcile health capacity open-tap watch flows metrics top'
_cubenetctl_global_opts='-h --help -V --version --bus= --varlink= --json= -j -q --quiet --no-legend --no-pager'
_cubenetctl_ensure_opts='--port= --allow-out= --deny-out= --egress-mode= --egress-rate= --ingress-rate= --egress-burst= --ingress-burst= --no-internet --mtu= --metadata= --idempotency-key= --clone-of= --paused --tap-owner= --egress-rules='
_cubenetctl_top_opts='--interval= --count='
_cubenetctl_flows_opts='--denied -f --follow --since='
# Options whose value may follow as the next word.
_cubenetctl_value_opts='--bus --varlink --port --allow-out --deny-out --egress-mode --egress-rate --ingress-rate --egress-burst --ingress-burst --mtu --metadata --idempotency-key --clone-of --egress-rules --interval --count --since'

# Sets _cubenetctl_words/_cubenetctl_cword: COMP_WORDS with the pieces that
# COMP_WORDBREAKS split off ("--json" "=" "pretty", "cni" ":" "x") joined
# again where no whitespace separated them on the command line.
_cubenetctl_reassemble() {
    local i w line=${COMP_LINE-} spaced trimmed
    _cubenetctl_words=()
    _cubenetctl_cword=0
    local n=-1
    for ((i = 0; i < ${#COMP_WORDS[@]}; i++)); do
        w=${COMP_WORDS[i]}
        spaced=1
        if [[ -n ${COMP_LINE-} ]]; then
            trimmed=${line#"${line%%[![:space:]]*}"}
            [[ ${#trimmed} -eq ${#line} ]] && spaced=0
            line=${trimmed#"$w"}
        fi
        if ((n >= 0)) && [[ $w == [=:] || ${COMP_WORDS[i - 1]} == *[=:] ]] &&
            { [[ -z ${COMP_LINE-} ]] || ((spaced == 0)); }; then
            _cubenetctl_words[n]+=$w
        else
            ((n++))
            _cubenetctl_words[n]=$w
        fi
        ((i == COMP_CWORD)) && _cubenetctl_cword=$n
    done
    # The cursor after a trailing space: a new, empty word.
    ((COMP_CWORD >= ${#COMP_WORDS[@]})) && _cubenetctl_cword=$((n + 1)) &&
        _cubenetctl_words[n + 1]=''
    return 0
}

# Sandbox ids from the agent, one per line; nothing if it cannot be asked.
_cubenetctl_ids() {
    local prog=$1
    shift
    if ! command -v "$prog" >/dev/null 2>&1; then
        prog=cubenetctl
    fi
    if command -v timeout >/dev/null 2>&1; then
        timeout 5 "$prog" "$@" list --no-legend -q 2>/dev/null
    else
        "$prog" "$@" list --no-legend -q 2>/dev/null
    fi | while read -r id _; do
        [[ -n $id ]] && printf '%s\n' "$id"
    done
    return 0
}

_cubenetctl() {
    local words cword
    _cubenetctl_reassemble
    words=("${_cubenetctl_words[@]}")
    cword=$_cubenetctl_cword
    local cur=${words[cword]-}
    local prev=''
    ((cword > 0)) && prev=${words[cword - 1]}

    # Find the command, its positional arguments and the --bus in use.
    local i w verb='' npos=0 dashdash=-1 skip=0
    local -a bus=()
    for ((i = 1; i < cword; i++)); do
        w=${words[i]}
        if ((skip)); then
            skip=0
            continue
        fi
        if ((dashdash >= 0)); then
            continue
        fi
        case $w in
        --) dashdash=$i ;;
        --bus=*) bus=("$w") ;;
        --bus)
            bus=(--bus "${words[i + 1]-}")
            skip=1
            ;;
        -*)
            [[ " $_cubenetctl_value_opts " == *" $w "* ]] && skip=1
            ;;
        *)
            if [[ -z $verb ]]; then
                verb=$w
            else
                ((npos++))
            fi
            ;;
        esac
    done

    local -a cands=()
    local opts="$_cubenetctl_global_opts"
    [[ $verb == ensure ]] && opts+=" $_cubenetctl_ensure_opts"
    [[ $verb == top ]] && opts+=" $_cubenetctl_top_opts"
    [[ $verb == flows ]] && opts+=" $_cubenetctl_flows_opts"

    if ((dashdash >= 0)); then
        # open-tap ID -- COMMAND ARGS...
        if ((cword == dashdash + 1)); then
            mapfile -t cands < <(compgen -c -- "$cur")
        else
            mapfile -t cands < <(compgen -f -- "$cur")
        fi
        COMPREPLY=("${cands[@]}")
        return 0
    fi

    # A value in the next word: --bus X, --port X...
    case $prev in
    --bus)
        mapfile -t COMPREPLY < <(compgen -W 'system session unix:path=' -- "$cur")
        _cubenetctl_finish "$cur"
        return 0
        ;;
    --varlink | --egress-rules)
        mapfile -t COMPREPLY < <(compgen -f -- "$cur")
        return 0
        ;;
    --egress-mode)
        mapfile -t COMPREPLY < <(compgen -W 'dns sni' -- "$cur")
        return 0
        ;;
    --since)
        mapfile -t COMPREPLY < <(compgen -W '30s 10m 1h' -- "$cur")
        return 0
        ;;
    --port | --allow-out | --deny-out | --mtu | --metadata | --idempotency-key | --clone-of | --interval | --count)
        [[ $prev == --port ]] && mapfile -t COMPREPLY < <(compgen -W 'tcp: udp:' -- "$cur")
        _cubenetctl_finish "$cur"
        return 0
        ;;
    esac

    case $cur in
    --json=*) cands=(--json=pretty --json=short --json=off) ;;
    --bus=*) cands=(--bus=system --bus=session --bus=unix:path=) ;;
    --port=*) cands=(--port=tcp: --port=udp:) ;;
    --egress-mode=*) cands=(--egress-mode=dns --egress-mode=sni) ;;
    --since=*) cands=(--since=30s --since=10m --since=1h) ;;
    --varlink=* | --egress-rules=*)
        local f opt=${cur%%=*}
        while IFS= read -r f; do cands+=("$opt=$f"); done < <(compgen -f -- "${cur#*=}")
        ;;
    --*=*) cands=() ;;
    -*) read -r -a cands <<<"$opts" ;;
    *)
        if [[ -z $verb ]]; then
            read -r -a cands <<<"$_cubenetctl_commands"
        elif ((npos == 0)); then
            case $verb in
            status | release | reconcile | open-tap | ensure | egress-rules | flows)
                mapfile -t cands < <(_cubenetctl_ids "${words[0]}" "${bus[@]}")
                ;;
            esac
        elif [[ $verb == open-tap && $npos -eq 1 ]]; then
            cands=(--)
        elif [[ $verb == egress-rules && $npos -eq 1 ]]; then
            # FILE: a JSON file of rules (- for stdin).
            mapfile -t COMPREPLY < <(compgen -f -- "$cur")
            return 0
        fi
        ;;
    esac
    mapfile -t COMPREPLY < <(compgen -W "${cands[*]}" -- "$cur")
    _cubenetctl_finish "$cur"
    return 0
}

# readline replaces only the text after the last COMP_WORDBREAKS character
# (= or :) of the word: cut that much off each candidate. A candidate that
# ends in = or : (an option or value to be continued) gets no space.
_cubenetctl_finish() {
    local cur=$1 breaks='' prefix='' i c
    [[ $COMP_WORDBREAKS == *=* ]] && breaks+='='
    [[ $COMP_WORDBREAKS == *:* ]] && breaks+=':'
    if [[ -n $breaks && $cur == *["$breaks"]* ]]; then
        prefix=${cur%"${cur##*["$breaks"]}"}
    fi
    for i in "${!COMPREPLY[@]}"; do
        c=${COMPREPLY[i]}
        if [[ $c == *[=:] ]]; then
            compopt -o nospace 2>/dev/null
        fi
        COMPREPLY[i]=${c#"$prefix"}
    done
    return 0
}

complete -F _cubenetctl cubenetctl
