//! Attachment: every TAP and veth joins the shared tc block (or keeps an
//! older build's filter of its own, with this build's program), node
//! devices get filters replaced in place, and `check` compares what the
//! kernel runs with what this build expects.

use super::*;

pub(super) fn prog_fd<'a>(
    progs: &'a Programs,
    name: &str,
) -> Result<BorrowedFd<'a>, DatapathError> {
    progs
        .get(name)
        .map(AsFd::as_fd)
        .ok_or_else(|| err("finding the program", name))
}

/// How a device came to run `from_guest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Joined {
    /// Its clsact is bound to the shared block.
    Bound,
    /// It has a clsact of its own (an older build's, or one an admin made):
    /// its filter now runs this build's `from_guest`, replaced in place.
    OwnFilter,
}

/// Makes `ifindex` run `from_guest`: creates its clsact qdisc bound to
/// `block`. A device that has a clsact already is never left without a
/// program: bound to `block`, nothing to do; a qdisc of its own gets the
/// filter replaced in place; bound to another block, the qdisc is
/// replaced only if `idle` (the anchor, a pool TAP nobody else ever
/// held), else it is an error (`tc_block` changed under live TAPs).
fn bind(progs: &Programs, ifindex: u32, block: u32, idle: bool) -> Result<Joined, DatapathError> {
    let what = "binding the clsact qdisc to the tc block";
    if tc::add_clsact(ifindex, Some(block)).map_err(|e| tc_err(what, ifindex, e))? {
        return Ok(Joined::Bound);
    }
    match tc::clsact_of(ifindex).map_err(|e| tc_err(what, ifindex, e))? {
        Some(Some(b)) if b == block => Ok(Joined::Bound),
        Some(None) if !idle => {
            let target = Target::Device {
                ifindex,
                hook: TcHook::Ingress,
            };
            tc::replace_filter(
                target,
                FILTER_PRIORITY,
                FILTER_HANDLE,
                prog_fd(progs, "from_guest")?,
                "from_guest",
            )
            .map_err(|e| tc_err("attaching the tc filter", ifindex, e))?;
            Ok(Joined::OwnFilter)
        }
        Some(Some(b)) if !idle => Err(err(
            what,
            format!(
                "ifindex {ifindex} is bound to tc block {b}, not {block} (was tc_block changed \
                 while sandboxes ran? their TAPs keep block {b} until they are released)"
            ),
        )),
        // Idle, or a qdisc that went meanwhile: nothing runs there.
        _ => {
            tc::del_clsact(ifindex).map_err(|e| tc_err(what, ifindex, e))?;
            if tc::add_clsact(ifindex, Some(block)).map_err(|e| tc_err(what, ifindex, e))? {
                Ok(Joined::Bound)
            } else {
                Err(err(
                    what,
                    format!("ifindex {ifindex} has an ingress qdisc that is not a clsact"),
                ))
            }
        }
    }
}

/// Puts `h` in the kernel: binds a device, or creates (or replaces in
/// place) a filter with this build's program.
pub(super) fn install(progs: &Programs, h: &Hook) -> Result<(), DatapathError> {
    let target = match h.place {
        // Only the anchor is installed this way (TAPs: `ensure_filter`).
        Place::Bound(block) => return bind(progs, h.ifindex, block, true).map(|_| ()),
        Place::Block(block) => Target::Block(block),
        Place::Filter(hook) => {
            tc::add_clsact(h.ifindex, None)
                .map_err(|e| tc_err("adding the clsact qdisc", &h.device, e))?;
            Target::Device {
                ifindex: h.ifindex,
                hook,
            }
        }
    };
    tc::replace_filter(
        target,
        FILTER_PRIORITY,
        FILTER_HANDLE,
        prog_fd(progs, h.program)?,
        h.program,
    )
    .map_err(|e| tc_err("attaching the tc filter", h, e))
}

/// The ingress binding of every `Place::Bound` hook (None for the others),
/// a request per device on two sockets in parallel when there are many:
/// linear in the devices, where a dump of every qdisc is quadratic.
pub(super) fn ingress_bindings(hooks: &[Hook]) -> Result<Vec<Option<tc::Binding>>, DatapathError> {
    let ask = |part: &[Hook]| -> std::io::Result<Vec<Option<tc::Binding>>> {
        if !part.iter().any(|h| matches!(h.place, Place::Bound(_))) {
            return Ok(vec![None; part.len()]);
        }
        let mut conn = tc::Conn::new()?;
        part.iter()
            .map(|h| match h.place {
                Place::Bound(_) => conn.ingress_binding(h.ifindex).map(Some),
                _ => Ok(None),
            })
            .collect()
    };
    let r = if hooks.len() > 512 {
        let (a, b) = hooks.split_at(hooks.len() / 2);
        std::thread::scope(|sc| {
            let other = sc.spawn(|| ask(b));
            let mut first = ask(a)?;
            first.extend(
                other
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p))?,
            );
            Ok(first)
        })
    } else {
        ask(hooks)
    };
    r.map_err(|e| err("asking the TAPs' ingress filters", e))
}

/// What is wrong with the datapath's filter on `target`, if anything.
fn filter_drift(target: Target, program: &str, tag: u64) -> std::io::Result<Option<String>> {
    let filters = tc::bpf_filters(target)?;
    Ok(
        match filters.iter().find(|f| f.priority == FILTER_PRIORITY) {
            None => Some("no bpf filter".into()),
            Some(f) if f.tag == tag => None,
            Some(f) => Some(format!(
                "runs {} tag {:016x} (id {}), not this build's {program} tag {tag:016x}",
                if f.name.is_empty() {
                    "a program"
                } else {
                    &f.name
                },
                f.tag,
                f.id
            )),
        },
    )
}

pub(super) use crate::netlink::link_exists;

impl EbpfDatapath {
    /// Binds a TAP's (or veth's) clsact qdisc to the shared block unless
    /// it is recorded as running `from_guest` already (bound, or an older
    /// build's filter of its own).
    pub(super) fn ensure_filter(
        &self,
        inner: &mut Inner,
        ifindex: u32,
    ) -> Result<(), DatapathError> {
        if inner.maps.attached.get(&ifindex, 0).is_err() {
            self.join(inner, ifindex, false)?;
        }
        Ok(())
    }

    /// Binds a device (see [`bind`]) and records how it runs `from_guest`.
    pub(super) fn join(
        &self,
        inner: &mut Inner,
        ifindex: u32,
        idle: bool,
    ) -> Result<(), DatapathError> {
        self.repair_block_if_lost()?;
        let joined = bind(&self.progs, ifindex, self.node.block, idle)?;
        {
            let mut own = self.own_filter.lock().unwrap_or_else(|p| p.into_inner());
            if joined == Joined::OwnFilter {
                own.insert(ifindex);
            } else {
                own.remove(&ifindex);
            }
        }
        self.stale
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(i, _)| *i != ifindex);
        inner
            .maps
            .attached
            .insert(
                ifindex,
                if joined == Joined::Bound {
                    BOUND
                } else {
                    OWN_FILTER
                },
                0,
            )
            .map_err(|e| err("recording the attachment", e))
    }

    /// After the kernel announced a removal on the block or its anchor:
    /// puts the anchor's binding and the block's filter back before a TAP
    /// joins, so that no TAP binds an empty block (a block dies with its
    /// last qdisc, and a new one has no filter).
    fn repair_block_if_lost(&self) -> Result<(), DatapathError> {
        if !self.block_lost.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        for h in self.node_hooks.iter().take(2) {
            if let Err(e) = install(&self.progs, h) {
                self.block_lost.store(true, Ordering::Release);
                return Err(err(
                    "the shared tc block",
                    format!("{h}: {e} (a TAP would run no program: restart the agent)"),
                ));
            }
        }
        info!("the tc block's anchor and filter put back");
        Ok(())
    }

    /// The TAPs and veths an earlier agent attached (`tap_attached`): bound
    /// to the block (2), they run this build's `from_guest` already (and
    /// recovery checks the binding); with a qdisc and filter of their own
    /// (1: a build before the shared block) the filter gets this build's
    /// program in place, one request each; gone from the kernel, they are
    /// forgotten (recovery attaches the ones a network still uses). Returns
    /// the devices with a filter of their own, the ones whose filter could
    /// not be replaced, and how many devices run `from_guest`.
    pub(super) fn take_over_taps(
        progs: &Programs,
        attached: &mut HashMap<MapData, u32, u32>,
    ) -> Result<TakenOver, DatapathError> {
        let recorded: Vec<(u32, u32)> = attached.iter().flatten().collect();
        let (mut own, mut stale, mut kept) = (HashSet::new(), vec![], 0);
        let fd = prog_fd(progs, "from_guest")?;
        for (ifindex, how) in recorded {
            if how == BOUND {
                kept += 1;
                continue;
            }
            let target = Target::Device {
                ifindex,
                hook: TcHook::Ingress,
            };
            let r = match tc::replace_filter(
                target,
                FILTER_PRIORITY,
                FILTER_HANDLE,
                fd,
                "from_guest",
            ) {
                Ok(()) => {
                    own.insert(ifindex);
                    kept += 1;
                    attached.insert(ifindex, OWN_FILTER, 0)
                }
                // Bound to a shared block after all.
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    kept += 1;
                    attached.insert(ifindex, BOUND, 0)
                }
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL | libc::ENOENT | libc::ENODEV)
                    ) =>
                {
                    attached.remove(&ifindex)
                }
                Err(e) => {
                    warn!(ifindex, error = %e, "could not replace an older build's from_guest filter");
                    // Its own filter still runs the older program: the
                    // check compares tags and Reconcile replaces it.
                    own.insert(ifindex);
                    kept += 1;
                    stale.push((ifindex, format!("ifindex {ifindex}: {e}")));
                    Ok(())
                }
            };
            if let Err(e) = r {
                warn!(ifindex, error = %crate::error_chain(&e), "updating tap_attached failed");
            }
        }
        if !own.is_empty() {
            info!(
                devices = own.len(),
                "TAPs attached by an older build keep their own filter, now with this build's from_guest"
            );
        }
        Ok(TakenOver { own, stale, kept })
    }

    /// Bindings from a filter request per device (two sockets in parallel
    /// for many); filters one dump each, compared by program tag with this
    /// build's. TAPs and veths that no longer exist are not reported (the
    /// caller's business); node devices are.
    pub(super) fn check_hooks(
        &self,
        hooks: &[Hook],
    ) -> Result<Vec<(usize, String)>, DatapathError> {
        let bindings = ingress_bindings(hooks)?;
        // Hooks with no filter at all are told apart by the node's qdisc
        // dump (taken once, only then).
        let mut all: Option<StdHashMap<u32, Option<u32>>> = None;
        let mut out = vec![];
        for (i, h) in hooks.iter().enumerate() {
            let tag = self.tags.get(h.program).map_or(0, |p| p.tag);
            let drift = match h.place {
                Place::Bound(block) => {
                    let binding = match bindings[i] {
                        Some(tc::Binding::NoQdisc) | None => None,
                        Some(tc::Binding::Block(b)) => Some(Some(b)),
                        Some(tc::Binding::Own) => Some(None),
                        Some(tc::Binding::NoFilter) => {
                            if all.is_none() {
                                all = Some(
                                    tc::clsact_qdiscs()
                                        .map_err(|e| err("listing clsact qdiscs", e))?,
                                );
                            }
                            all.as_ref().and_then(|a| a.get(&h.ifindex).copied())
                        }
                    };
                    match binding {
                        Some(Some(b)) if b == block => None,
                        Some(Some(b)) => {
                            Some(format!("ingress bound to tc block {b}, not {block}"))
                        }
                        Some(None) => Some(format!(
                            "clsact qdisc of its own, not bound to tc block {block}"
                        )),
                        None => Some("no clsact qdisc".into()),
                    }
                }
                Place::Block(block) => filter_drift(Target::Block(block), h.program, tag)
                    .map_err(|e| tc_err("listing tc filters", &h.device, e))?,
                Place::Filter(hook) => {
                    let target = Target::Device {
                        ifindex: h.ifindex,
                        hook,
                    };
                    match filter_drift(target, h.program, tag) {
                        Ok(d) => d,
                        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => None,
                        Err(e) => return Err(tc_err("listing tc filters", &h.device, e)),
                    }
                }
            };
            // A TAP or veth that is gone is the caller's business; a node
            // device that is gone (the anchor above all) is reported.
            if let Some(d) = drift {
                if h.ifindex == BLOCK_IFINDEX || link_exists(h.ifindex) {
                    out.push((i, d));
                } else if self.node_hooks.contains(h) {
                    out.push((
                        i,
                        format!("device gone ({d}); restart the agent to recreate it"),
                    ));
                }
            }
        }
        Ok(out)
    }
}
