//! Which freed model-run blocks to keep for the next run, and which to give back.
//!
//! A session without ONNX Runtime's arena takes every activation from malloc, and a
//! block of 4 MiB or more is mapped fresh each run: the kernel zeroes each page again on
//! first touch, which cost U2NetP about 20 % of its run at 320x320 on 2 cores (measured
//! against the arena in one process). The arena avoids that by keeping its peak for the
//! session's life, rounded up to its growth steps (about 475 MB a U2NetP session), in
//! every session: two replicas and a solo set would hold three of them.
//!
//! This cache is one for all the sessions of the process, and keeps freed blocks under
//! one rule: the blocks it holds plus the blocks in use never exceed the most that was
//! ever in use at once (the high-water mark) by more than a quarter of what one run held
//! at its peak while no other run was in flight (the lone-run mark), plus what the runs
//! have shown they need beyond that (below). A miss first gives back cached blocks,
//! oldest first, until the new block fits under that ceiling. A block is taken again by
//! best fit, up to an eighth larger than asked.
//!
//! Why a quarter of a lone run: a run needs, for each block size, as many blocks as it
//! ever holds of that size at once, and those maxima add up to more than the run's peak;
//! for U2NetP at 320x320 they add up to 300.7 MB against a 244.7 MB peak (1.23x), so under
//! a ceiling of the peak itself about half of each run's bytes were mapped afresh
//! (simulated on a recorded run), and under a quarter above it none are. Runs in flight
//! together are at different points of the model, so they share one margin: with two
//! U2NetP replicas (a 489 MB mark), a ceiling of the mark itself mapped 66 MB afresh per
//! run, one lone run's quarter above it 14 MB and a quarter of the whole mark above it
//! 8 MB, while the peak RSS of `celer serve` flooded by 4 clients with 1080p photos grew
//! by 8, 48 and 106 MB over no cache (`celer bench local --model-only`,
//! `hostile_figures.rss_figure`). Until a lone run is seen the margin is nothing.
//!
//! A quarter is not enough for every model. U2NetP's INT8 variant holds tensors of many
//! more sizes (8-bit activations, and the float ones around the convolutions kept in
//! FP32): its per-size maxima add up to 207 MB against an 84 MB peak (2.5x), so under a
//! quarter's margin a lone run gave back and mapped again about 217 MB each time, and
//! took 122-130 ms against 108-110 with nothing given back (`celer bench local`, 320x320,
//! 2 threads). So the margin also learns: when a run ends, the bytes given back to make
//! room and then mapped again while it ran (the churn), when more than an eighth of the
//! high-water mark and the mark did not grow meanwhile, are added to it, up to the
//! ceiling of `MAX_CEILING` times the mark. A
//! model whose blocks fit the quarter churns little or not at all, and its ceiling stays
//! where it was: learning from the FP32 model's small churn too held 36 MB more for its
//! two replicas and took `celer serve`'s peak RSS under 4 clients on 1080p photos from
//! 753-810 MB to 815-819 MB, for no speed.
//!
//! This module only keeps the books (addresses and sizes); `allocator` maps and
//! unmaps the memory, and tells it when runs start and end.

use std::collections::BTreeMap;

/// Every block is a multiple of this, and aligned to it: ONNX Runtime's CPU kernels
/// expect 64-byte alignment.
pub const BLOCK_ALIGN: usize = 64;

/// The most the learnt margin lets the cache hold, in and out of use, as a multiple of
/// the high-water mark: room for U2NetP's INT8 variant (2.5x its peak, measured).
pub const MAX_CEILING: usize = 3;

/// The churn a run must pass to widen the margin: one part in this many of the
/// high-water mark. The FP32 model's two replicas side by side map 7-8 MB a run afresh
/// against a 489 MB mark, the price of the quarter's memory (decisions.md), and learn
/// nothing; the INT8 variant's runs mapped 190-217 MB against an 84-166 MB mark.
pub const CHURN_LEARNT: usize = 8;

/// A block of memory: its address and its size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub addr: usize,
    pub size: usize,
}

/// The answer to a request: a cached block to reuse, or the size to map and the cached
/// blocks to give back first.
#[derive(Debug, PartialEq, Eq)]
pub enum Take {
    Reuse(Block),
    Map { size: usize, release: Vec<Block> },
}

/// Counts since the start, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    pub reused: u64,
    pub mapped: u64,
    /// The bytes of the blocks mapped: what the kernel zeroed afresh.
    pub mapped_bytes: u64,
    pub released: u64,
    pub in_use: usize,
    pub cached: usize,
    /// The most ever in use at once.
    pub high_water: usize,
    /// The most ever in use while one run alone was in flight.
    pub lone_high_water: usize,
    /// Model runs in flight now.
    pub runs: usize,
    /// The margin learnt from churn (the module's doc), on top of a quarter of the
    /// lone-run mark.
    pub learnt_margin: usize,
}

impl CacheStats {
    /// The ceiling these counts set ([`BlockCache::ceiling`]).
    pub fn ceiling(&self) -> usize {
        (self.high_water + self.lone_high_water / 4 + self.learnt_margin)
            .min(self.high_water * MAX_CEILING)
    }
}

impl std::fmt::Display for CacheStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |bytes: usize| bytes as f64 / 1e6;
        write!(
            f,
            "block cache: {} blocks reused, {} mapped ({:.1} MB), {} given back; {:.1} MB in \
             use, {:.1} MB cached, high-water mark {:.1} MB ({:.1} MB by a lone run), \
             {:.1} MB of margin learnt",
            self.reused,
            self.mapped,
            self.mapped_bytes as f64 / 1e6,
            self.released,
            mb(self.in_use),
            mb(self.cached),
            mb(self.high_water),
            mb(self.lone_high_water),
            mb(self.learnt_margin)
        )
    }
}

#[derive(Debug)]
pub struct BlockCache {
    /// Blocks handed out, by address: `give_back` learns a block's size here.
    live: BTreeMap<usize, usize>,
    /// Cached blocks by (size, age), for best fit.
    by_size: BTreeMap<(usize, u64), usize>,
    /// Cached blocks by age, for giving back the oldest first.
    by_age: BTreeMap<u64, Block>,
    clock: u64,
    stats: CacheStats,
    /// Bytes given back to make room, and bytes mapped, since a run last ended: their
    /// lesser is the churn that run_ended adds to the margin.
    released_since: usize,
    mapped_since: usize,
    /// The high-water mark when a run last ended.
    mark_since: usize,
}

impl Default for BlockCache {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockCache {
    pub const fn new() -> Self {
        BlockCache {
            live: BTreeMap::new(),
            by_size: BTreeMap::new(),
            by_age: BTreeMap::new(),
            clock: 0,
            stats: CacheStats {
                reused: 0,
                mapped: 0,
                mapped_bytes: 0,
                released: 0,
                in_use: 0,
                cached: 0,
                high_water: 0,
                lone_high_water: 0,
                runs: 0,
                learnt_margin: 0,
            },
            released_since: 0,
            mapped_since: 0,
            mark_since: 0,
        }
    }

    /// What `bytes` is rounded up to.
    pub fn block_size(bytes: usize) -> usize {
        bytes.max(1).div_ceil(BLOCK_ALIGN) * BLOCK_ALIGN
    }

    /// A block for `bytes`. After `Take::Map`, the caller maps the block and reports it
    /// with `mapped` (or `map_failed`), and unmaps the blocks in `release`.
    pub fn take(&mut self, bytes: usize) -> Take {
        let size = Self::block_size(bytes);
        let fit = self
            .by_size
            .range((size, 0)..=(size + size / 8, u64::MAX))
            .next()
            .map(|(&key, &addr)| (key, addr));
        if let Some(((found, age), addr)) = fit {
            self.by_size.remove(&(found, age));
            self.by_age.remove(&age);
            self.stats.cached -= found;
            self.use_bytes(found);
            self.stats.reused += 1;
            self.live.insert(addr, found);
            return Take::Reuse(Block { addr, size: found });
        }
        // Reserved now, so the marks count it even before the caller maps it.
        self.use_bytes(size);
        let mut release = Vec::new();
        while self.stats.in_use + self.stats.cached > self.ceiling() {
            let Some((age, block)) = self.by_age.pop_first() else {
                break;
            };
            self.by_size.remove(&(block.size, age));
            self.stats.cached -= block.size;
            self.stats.released += 1;
            self.released_since += block.size;
            release.push(block);
        }
        Take::Map { size, release }
    }

    fn use_bytes(&mut self, size: usize) {
        let stats = &mut self.stats;
        stats.in_use += size;
        stats.high_water = stats.high_water.max(stats.in_use);
        if stats.runs == 1 {
            stats.lone_high_water = stats.lone_high_water.max(stats.in_use);
        }
    }

    /// The most the cache lets in use and cached blocks add up to: the most ever in use
    /// at once, plus a quarter of the most one run alone held, plus the margin learnt
    /// from churn; never above `MAX_CEILING` times the most ever in use.
    pub fn ceiling(&self) -> usize {
        self.stats.ceiling()
    }

    /// A model run starts: while it is the only one in flight, what is in use counts
    /// towards the lone-run mark.
    pub fn run_started(&mut self) {
        self.stats.runs += 1;
        if self.stats.runs == 1 {
            self.stats.lone_high_water = self.stats.lone_high_water.max(self.stats.in_use);
        }
    }

    /// A model run has ended (whether or not it succeeded): what was given back and
    /// mapped again meanwhile widens the margin, so the next run need not, when it is
    /// more than one part in `CHURN_LEARNT` of the high-water mark and the mark did not
    /// grow meanwhile (a new mark's churn is the cache filling: replicas starting side by
    /// side, not a ceiling too low for what runs).
    pub fn run_ended(&mut self) {
        self.stats.runs = self.stats.runs.saturating_sub(1);
        let churn = self.released_since.min(self.mapped_since);
        let mark = self.stats.high_water;
        if churn * CHURN_LEARNT > mark && mark == self.mark_since {
            self.stats.learnt_margin = (self.stats.learnt_margin + churn).min(mark * MAX_CEILING);
        }
        self.released_since = 0;
        self.mapped_since = 0;
        self.mark_since = mark;
    }

    /// The block that `take` asked for is mapped at `addr`.
    pub fn mapped(&mut self, addr: usize, size: usize) {
        self.stats.mapped += 1;
        self.stats.mapped_bytes += size as u64;
        self.mapped_since += size;
        self.live.insert(addr, size);
    }

    /// The block that `take` asked for could not be mapped.
    pub fn map_failed(&mut self, size: usize) {
        self.stats.in_use -= size;
    }

    /// The block at `addr` is free: it is kept for the next request. None when `addr`
    /// was not handed out here.
    pub fn give_back(&mut self, addr: usize) -> Option<()> {
        let size = self.live.remove(&addr)?;
        self.clock += 1;
        self.by_size.insert((size, self.clock), addr);
        self.by_age.insert(self.clock, Block { addr, size });
        self.stats.in_use -= size;
        self.stats.cached += size;
        Some(())
    }

    /// Empties the cache (the server has gone idle): the caller unmaps these.
    pub fn drain(&mut self) -> Vec<Block> {
        self.by_size.clear();
        self.stats.released += self.by_age.len() as u64;
        self.stats.cached = 0;
        std::mem::take(&mut self.by_age).into_values().collect()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plays the caller's part: a fake address space that checks nothing is mapped twice
    /// and nothing unknown is unmapped.
    struct Heap {
        cache: BlockCache,
        next: usize,
        mapped: BTreeMap<usize, usize>,
    }

    impl Heap {
        fn new() -> Self {
            Heap {
                cache: BlockCache::default(),
                next: 1 << 20,
                mapped: BTreeMap::new(),
            }
        }

        fn alloc(&mut self, bytes: usize) -> usize {
            match self.cache.take(bytes) {
                Take::Reuse(block) => {
                    assert!(block.size >= bytes && self.mapped[&block.addr] == block.size);
                    block.addr
                }
                Take::Map { size, release } => {
                    for block in release {
                        assert_eq!(self.mapped.remove(&block.addr), Some(block.size));
                    }
                    let addr = self.next;
                    self.next += size + BLOCK_ALIGN;
                    self.mapped.insert(addr, size);
                    self.cache.mapped(addr, size);
                    addr
                }
            }
        }

        fn free(&mut self, addr: usize) {
            assert_eq!(self.cache.give_back(addr), Some(()));
        }

        fn held(&self) -> usize {
            self.mapped.values().sum()
        }
    }

    /// One run of a model: activations of a few sizes, each freed after the next is made.
    fn run(heap: &mut Heap, sizes: &[usize]) -> usize {
        heap.cache.run_started();
        let peak = steps(heap, sizes);
        heap.cache.run_ended();
        peak
    }

    /// The allocations of `run`, without telling the cache a run is in flight.
    fn steps(heap: &mut Heap, sizes: &[usize]) -> usize {
        let mut peak = 0;
        let mut previous = None;
        for &bytes in sizes {
            let block = heap.alloc(bytes);
            peak = peak.max(heap.held());
            if let Some(p) = previous.replace(block) {
                heap.free(p);
            }
        }
        if let Some(p) = previous {
            heap.free(p);
        }
        peak
    }

    const RUN: [usize; 7] = [26 << 20, 6 << 20, 6 << 20, 1 << 20, 6 << 20, 26 << 20, 4000];

    #[test]
    fn the_second_run_of_the_same_model_maps_nothing() {
        let mut heap = Heap::new();
        run(&mut heap, &RUN);
        let first = heap.cache.stats();
        run(&mut heap, &RUN);
        run(&mut heap, &RUN);
        let later = heap.cache.stats();
        assert_eq!(later.mapped, first.mapped, "{first:?} then {later:?}");
        assert_eq!(later.reused - first.reused, 2 * RUN.len() as u64);
        assert_eq!(later.in_use, 0);
    }

    #[test]
    fn what_is_held_stays_under_the_ceiling_and_the_ceiling_under_its_cap() {
        let mut heap = Heap::new();
        // Sizes that grow each round, so fit no cached block: each miss must first give
        // blocks back.
        for round in 1..=20usize {
            let sizes: Vec<usize> = RUN.iter().map(|s| s + round * 100_000).collect();
            let peak_held = run(&mut heap, &sizes);
            let stats = heap.cache.stats();
            assert_eq!(heap.held(), stats.in_use + stats.cached);
            assert!(
                peak_held <= heap.cache.ceiling(),
                "{peak_held} in {stats:?}"
            );
            assert!(heap.cache.ceiling() <= stats.high_water * MAX_CEILING);
            // Two blocks live at once in `run`: the mark is the largest adjacent pair.
            let blocks: Vec<usize> = sizes.iter().map(|&s| BlockCache::block_size(s)).collect();
            let pair = blocks.windows(2).map(|w| w[0] + w[1]).max();
            assert_eq!(Some(stats.high_water), pair);
            assert_eq!(stats.lone_high_water, stats.high_water, "one run at a time");
        }
        assert!(heap.cache.stats().released > 0);
    }

    /// A run whose blocks are of many sizes, each freed only at the end of its phase:
    /// their per-size maxima add up to about twice its peak.
    fn many_sizes(heap: &mut Heap) {
        heap.cache.run_started();
        for phase in 0..4usize {
            let blocks: Vec<usize> = (0..3)
                .map(|i| heap.alloc((1 << 20) * (4 + 3 * phase + i)))
                .collect();
            for block in blocks {
                heap.free(block);
            }
        }
        heap.cache.run_ended();
    }

    #[test]
    fn a_run_that_churns_widens_the_margin_until_the_next_maps_nothing() {
        let mut heap = Heap::new();
        many_sizes(&mut heap);
        many_sizes(&mut heap);
        let churned = heap.cache.stats();
        assert!(
            churned.released > 0,
            "under a quarter's margin: {churned:?}"
        );
        assert!(churned.learnt_margin > 0, "{churned:?}");
        for _ in 0..3 {
            many_sizes(&mut heap);
        }
        let settled = heap.cache.stats();
        many_sizes(&mut heap);
        let last = heap.cache.stats();
        assert_eq!(last.mapped, settled.mapped, "{settled:?} then {last:?}");
        assert_eq!(last.released, settled.released);
        assert!(heap.held() <= heap.cache.ceiling());
        assert!(heap.cache.ceiling() <= last.high_water * MAX_CEILING);
    }

    #[test]
    fn a_churn_under_an_eighth_of_the_mark_is_not_learnt() {
        let mut heap = Heap::new();
        run(&mut heap, &RUN);
        // A 2 MiB block fits no cached one, and the cache is near its ceiling: a block is
        // given back to map it, 2 MiB of churn against a 32 MiB mark.
        run(&mut heap, &[2 << 20]);
        let stats = heap.cache.stats();
        assert!(stats.released > 0, "{stats:?}");
        assert_eq!(stats.learnt_margin, 0, "{stats:?}");
    }

    #[test]
    fn the_same_model_run_again_learns_no_margin() {
        let mut heap = Heap::new();
        for _ in 0..4 {
            run(&mut heap, &RUN);
        }
        assert_eq!(heap.cache.stats().learnt_margin, 0);
    }

    #[test]
    fn runs_in_flight_together_share_one_runs_margin() {
        let mut heap = Heap::new();
        run(&mut heap, &RUN);
        let lone = heap.cache.stats().lone_high_water;
        assert_eq!(lone, (26 << 20) + (6 << 20));
        // A second run starts while the first holds its largest block: both in flight,
        // so the lone-run mark stays and only the high-water mark grows.
        heap.cache.run_started();
        let first = heap.alloc(26 << 20);
        heap.cache.run_started();
        steps(&mut heap, &RUN);
        heap.cache.run_ended();
        heap.free(first);
        heap.cache.run_ended();
        let stats = heap.cache.stats();
        assert_eq!(stats.lone_high_water, lone);
        assert_eq!(stats.high_water, (26 << 20) + lone, "{stats:?}");
        // The second run's blocks given back and mapped again came with a new mark:
        // the cache filling, not learnt.
        assert!(stats.released > 0, "{stats:?}");
        assert_eq!(stats.learnt_margin, 0);
        assert_eq!(heap.cache.ceiling(), stats.high_water + lone / 4);
        assert!(heap.held() <= heap.cache.ceiling());
        assert_eq!(stats.runs, 0);
    }

    #[test]
    fn before_any_lone_run_the_ceiling_is_the_mark_itself() {
        let mut heap = Heap::new();
        steps(&mut heap, &RUN);
        let stats = heap.cache.stats();
        assert_eq!(stats.lone_high_water, 0);
        assert_eq!(heap.cache.ceiling(), stats.high_water);
        assert!(heap.held() <= stats.high_water);
    }

    #[test]
    fn a_block_too_large_for_the_request_is_not_taken() {
        let mut heap = Heap::new();
        let big = heap.alloc(8 << 20);
        heap.free(big);
        // 8 MiB is more than an eighth above 4 MiB: a new block, the big one given back.
        let small = heap.alloc(4 << 20);
        assert_ne!(small, big);
        assert!(!heap.mapped.contains_key(&big));
        // Within an eighth: reused.
        heap.free(small);
        assert_eq!(heap.alloc((4 << 20) - 1000), small);
    }

    #[test]
    fn drain_hands_back_every_cached_block_and_keeps_the_live_ones() {
        let mut heap = Heap::new();
        let a = heap.alloc(1000);
        let b = heap.alloc(2000);
        heap.free(a);
        let drained = heap.cache.drain();
        assert_eq!(
            drained,
            vec![Block {
                addr: a,
                size: 1024
            }]
        );
        let stats = heap.cache.stats();
        assert_eq!((stats.in_use, stats.cached), (2048, 0));
        heap.free(b);
        assert_eq!(
            heap.cache.give_back(a),
            None,
            "a drained block is no longer ours"
        );
    }
}
