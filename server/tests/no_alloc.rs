//! A decision allocates nothing: a counting global allocator watches every
//! placement and migration check over the shipped scenarios.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use fairplace::offline::scenario::{Answer, parse};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn decisions_allocate_nothing() {
    let text = include_str!("cases/examples.jsonl");
    let scenarios: Vec<_> = text
        .lines()
        .map(|l| parse(&serde_json::from_str(l).unwrap()).unwrap())
        .collect();
    let mut placements = 0;
    let mut migrations = 0;
    for s in &scenarios {
        let before = ALLOCS.load(Ordering::SeqCst);
        let a = std::hint::black_box(s.decide());
        let after = ALLOCS.load(Ordering::SeqCst);
        assert_eq!(after - before, 0, "{:?} allocated", s.name);
        match a {
            Answer::Place(_) => placements += 1,
            Answer::Migrate(_) => migrations += 1,
        }
    }
    assert!(placements > 30 && migrations > 5);
    // The counter does see allocations, so the zero above means something.
    let before = ALLOCS.load(Ordering::SeqCst);
    std::hint::black_box(vec![1u8; 16]);
    assert!(ALLOCS.load(Ordering::SeqCst) > before);
}
