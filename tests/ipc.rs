//! Sharing device memory between processes on the simulator: a block
//! exported by this process is imported by a child process (this test
//! binary again, run for `ipc_child` with a socket path in the
//! environment), which gets the chunks' file descriptors over a unix
//! socket (SCM_RIGHTS), reads the bytes written here and writes others
//! that this process then reads. Plus the rules of `src/pool/ipc.rs` in
//! one process: bad input, unknown and paused pointers, segment mode.

use gpupool::backend::sim::SimBackend;
use gpupool::backend::Backend;
use gpupool::{DevicePool, DevicePtr, Error, IpcHandle};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;

mod common;

const MIB: u64 = 1 << 20;
const CHILD_ENV: &str = "GPUPOOL_IPC_TEST_SOCKET";

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read(sim: &SimBackend, p: DevicePtr, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    sim.copy_to_host(0, p, &mut buf).unwrap();
    buf
}

/// A message header over one buffer and a control buffer (whole words,
/// aligned for `cmsghdr`); both must outlive its use.
fn header(iov: &mut libc::iovec, control: &mut [u64]) -> libc::msghdr {
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(control) as _;
    msg
}

/// Sends `data` and `fds` in one message (SCM_RIGHTS).
fn send_fds(sock: &UnixStream, data: &[u8], fds: &[RawFd]) {
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    // u64 words: the control buffer must be aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let msg = header(&mut iov, &mut control);
    // SAFETY: `msg` points at a control buffer of `space` bytes, enough
    // for one header and `fds`; CMSG_FIRSTHDR/CMSG_DATA stay inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
        std::ptr::copy_nonoverlapping(
            fds.as_ptr(),
            libc::CMSG_DATA(cmsg).cast::<RawFd>(),
            fds.len(),
        );
    }
    // SAFETY: `msg` and everything it points at are valid for the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, 0) };
    assert_eq!(
        n,
        data.len() as isize,
        "sendmsg: {}",
        std::io::Error::last_os_error()
    );
}

/// Receives one message with up to 64 descriptors (SCM_RIGHTS).
fn recv_fds(sock: &UnixStream) -> (Vec<u8>, Vec<OwnedFd>) {
    let mut data = vec![0u8; 4096];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(64 * std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let mut msg = header(&mut iov, &mut control);
    // SAFETY: `msg` and its buffers are valid for writes of their lengths.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(n > 0, "recvmsg: {}", std::io::Error::last_os_error());
    data.truncate(n as usize);
    let mut fds = Vec::new();
    // SAFETY: the kernel filled the control buffer; the CMSG_* walk stays
    // inside `msg_controllen`, and each SCM_RIGHTS descriptor is new and
    // owned by this process from here on.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    (data, fds)
}

/// The numbers of a handle as text: `chunk_bytes offset size fd_offset...`.
fn describe(h: &IpcHandle) -> String {
    let mut s = format!("{} {} {}", h.chunk_bytes, h.offset, h.size);
    for c in &h.chunks {
        s += &format!(" {}", c.fd_offset);
    }
    s
}

fn import_all(dev: &DevicePool, fds: &[OwnedFd], nums: &[u64]) -> gpupool::Result<DevicePtr> {
    let pairs: Vec<(BorrowedFd<'_>, u64)> = fds
        .iter()
        .map(|f| f.as_fd())
        .zip(nums[3..].iter().copied())
        .collect();
    dev.import(&pairs, nums[0], nums[1], nums[2])
}

/// The child's side of `bytes_cross_between_two_processes`; returns at
/// once in an ordinary test run.
#[test]
fn ipc_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut sock = UnixStream::connect(path).unwrap();
    let (data, fds) = recv_fds(&sock);
    let nums: Vec<u64> = std::str::from_utf8(&data)
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(fds.len(), nums.len() - 3);
    let (rt, sim) = common::sim_runtime("backend=sim,devices=1,capacity=64MiB");
    let dev = rt.device(0).unwrap();
    let size = nums[2] as usize;
    let p = import_all(dev, &fds, &nums).unwrap();
    drop(fds); // the import holds its own
    assert_eq!(read(&sim, p, size), pattern(7, size), "the parent's bytes");
    sim.copy_from_host(0, p, &pattern(8, size)).unwrap();
    // Imported memory is the exporter's: none held here, none in the stats.
    assert_eq!(sim.used_bytes(0), 0);
    let st = dev.audit().unwrap();
    assert_eq!(st.reserved_bytes.current, 0);
    dev.close_import(p).unwrap();
    assert!(matches!(
        dev.close_import(p),
        Err(Error::UnknownPointer { .. })
    ));
    sock.write_all(b"ok").unwrap();
}

#[test]
fn bytes_cross_between_two_processes() {
    let (rt, sim) = common::sim_runtime("backend=sim,devices=1,capacity=256MiB");
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    // A neighbour first, so that the block starts inside a granule.
    let pad = dev.alloc_raw(300_000, s).unwrap();
    let size = 5 * MIB as usize + 123;
    let p = dev.alloc_raw(size, s).unwrap();
    sim.copy_from_host(0, p, &pattern(7, size)).unwrap();
    let h = dev.export(p).unwrap();
    assert_eq!(h.size, size as u64);
    assert_eq!(
        h.chunks.len() as u64,
        (h.offset + h.size).div_ceil(h.chunk_bytes),
        "one chunk per granule"
    );

    let dir = std::env::temp_dir().join(format!("gpupool-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["ipc_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &path)
        .spawn()
        .unwrap();
    let (mut conn, _) = listener.accept().unwrap();
    let fds: Vec<RawFd> = h.chunks.iter().map(|c| c.fd.as_raw_fd()).collect();
    send_fds(&conn, describe(&h).as_bytes(), &fds);
    drop(h); // the child has its own descriptors now
    let mut reply = Vec::new();
    conn.read_to_end(&mut reply).unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "child failed: {status}");
    assert_eq!(reply, b"ok");
    assert_eq!(read(&sim, p, size), pattern(8, size), "the child's bytes");
    dev.free_raw(p, s).unwrap();
    dev.free_raw(pad, s).unwrap();
    dev.audit().unwrap();
}

#[test]
fn an_import_in_the_same_process_sees_the_same_bytes() {
    let (rt, sim) = common::sim_runtime("backend=sim,devices=2,capacity=64MiB");
    let d0 = rt.device(0).unwrap();
    let d1 = rt.device(1).unwrap();
    let s = d0.default_stream();
    let p = d0.alloc_raw(3 * MIB as usize, s).unwrap();
    sim.copy_from_host(0, p, &pattern(1, 3 * MIB as usize))
        .unwrap();
    let h = d0.export(p).unwrap();
    let nums: Vec<u64> = describe(&h)
        .split(' ')
        .map(|t| t.parse().unwrap())
        .collect();
    let fds: Vec<OwnedFd> = h.chunks.into_iter().map(|c| c.fd).collect();
    let q = import_all(d1, &fds, &nums).unwrap();
    let mut buf = vec![0u8; 3 * MIB as usize];
    sim.copy_to_host(1, q, &mut buf).unwrap();
    assert_eq!(buf, pattern(1, 3 * MIB as usize));
    // Writes show on both sides: one physical memory.
    sim.copy_from_host(1, q, &pattern(2, 4096)).unwrap();
    assert_eq!(read(&sim, p, 4096), pattern(2, 4096));
    d1.close_import(q).unwrap();
    // Freed and trimmed on the exporting side: the shared range is never
    // reused, the importer may still hold it.
    d0.free_raw(p, s).unwrap();
    d0.trim().unwrap();
    assert_eq!(sim.used_bytes(0), 0);
    assert_eq!(sim.used_bytes(1), 0);
    d0.audit().unwrap();
    d1.audit().unwrap();
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let (rt, sim) = common::sim_runtime("backend=sim,devices=1,capacity=64MiB");
    let dev = rt.device(0).unwrap();
    let s = dev.default_stream();
    let p = dev.alloc_raw(3 * MIB as usize, s).unwrap();
    let h = dev.export(p).unwrap();
    let before = sim.counters();
    let fd = h.chunks[0].fd.as_fd();
    let off = h.chunks[0].fd_offset;
    let g = h.chunk_bytes;
    for (chunks, cb, offset, size) in [
        (vec![], g, 0, 1),              // no chunk
        (vec![(fd, off)], g, 0, 0),     // no byte
        (vec![(fd, off)], g, g, 1),     // offset past the chunk
        (vec![(fd, off)], g, 0, g + 1), // more than the chunks hold
        (vec![(fd, off)], g / 2, 0, 1), // not whole granules
        (vec![(fd, off)], 0, 0, 1),     // no chunk size
    ] {
        let e = dev.import(&chunks, cb, offset, size).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    assert_eq!(
        sim.counters().since(&before).total_calls(),
        0,
        "refused before any call"
    );
    // A descriptor that is not shared device memory: a pipe.
    let (r, _w) = {
        let mut fds = [0; 2];
        // SAFETY: `fds` is valid for two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: pipe() just returned both, owned by nobody else.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    };
    let e = dev.import(&[(r.as_fd(), 0)], g, 0, 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // The shared file but past its end.
    let e = dev.import(&[(fd, 1 << 40)], g, 0, 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let st = dev.audit().unwrap();
    assert_eq!(sim.used_bytes(0), st.reserved_bytes.current);
    assert!(matches!(
        dev.close_import(p),
        Err(Error::UnknownPointer { .. })
    ));

    // Export: unknown, interior, freed, paused, a small Block.
    assert!(matches!(
        dev.export(DevicePtr(0x1000)),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        dev.export(p.offset(256)),
        Err(Error::UnknownPointer { .. })
    ));
    let q = dev.alloc_raw(4 * MIB as usize, s).unwrap();
    dev.free_raw(q, s).unwrap();
    assert!(dev.export(q).is_err(), "a freed block");
    let t = dev.alloc_raw_tagged(MIB as usize, s, 1).unwrap();
    dev.pause(1, false).unwrap();
    assert!(matches!(dev.export(t), Err(Error::InvalidArgument(_))));
    dev.resume(1).unwrap();
    dev.export(t).unwrap();
    let b = dev.alloc(1000, s).unwrap();
    assert!(matches!(
        dev.export(b.ptr()),
        Err(Error::InvalidArgument(_))
    ));
    let small = dev.alloc_raw(1000, s).unwrap();
    let hs = dev.export(small).unwrap();
    assert_eq!((hs.chunks.len(), hs.size), (1, 1000));
    drop((b, h, hs));
    for x in [p, t, small] {
        dev.free_raw(x, s).unwrap();
    }
    dev.audit().unwrap();
}

#[test]
fn segment_mode_cannot_share() {
    let (rt, _sim) = common::sim_runtime("backend=sim,devices=1,capacity=64MiB,vmm=false");
    let dev = rt.device(0).unwrap();
    let p = dev.alloc_raw(MIB as usize, dev.default_stream()).unwrap();
    assert!(matches!(dev.export(p), Err(Error::Unsupported(_))));
    // SAFETY: fd 0 is open for the whole test (stdin); borrowed only.
    let fd = unsafe { BorrowedFd::borrow_raw(0) };
    assert!(matches!(
        dev.import(&[(fd, 0)], 2 * MIB, 0, 1),
        Err(Error::Unsupported(_))
    ));
    dev.free_raw(p, dev.default_stream()).unwrap();
}
