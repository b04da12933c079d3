package main

// pyRandom reproduces CPython's random.Random for the calls workload.py makes: seeding from a
// non-negative int (MT19937's init_by_array over the int's 32-bit words, least significant
// first) and choice() through getrandbits (_randbelow_with_getrandbits). The turn messages the
// Python driver sends are then the same bytes here (tests/e2e/test_load_turn_driver.py compares).
type pyRandom struct {
	mt  [624]uint32
	idx int
}

func newPyRandom(seed uint64) *pyRandom {
	var key []uint32
	for n := seed; n > 0; n >>= 32 {
		key = append(key, uint32(n))
	}
	if len(key) == 0 {
		key = []uint32{0}
	}
	r := &pyRandom{}
	r.initByArray(key)
	return r
}

func (r *pyRandom) initGenrand(s uint32) {
	r.mt[0] = s
	for i := 1; i < 624; i++ {
		r.mt[i] = 1812433253*(r.mt[i-1]^(r.mt[i-1]>>30)) + uint32(i)
	}
	r.idx = 624
}

func (r *pyRandom) initByArray(key []uint32) {
	r.initGenrand(19650218)
	i, j := 1, 0
	k := max(624, len(key))
	for ; k > 0; k-- {
		r.mt[i] = (r.mt[i] ^ ((r.mt[i-1] ^ (r.mt[i-1] >> 30)) * 1664525)) + key[j] + uint32(j)
		i++
		j++
		if i >= 624 {
			r.mt[0] = r.mt[623]
			i = 1
		}
		if j >= len(key) {
			j = 0
		}
	}
	for k = 623; k > 0; k-- {
		r.mt[i] = (r.mt[i] ^ ((r.mt[i-1] ^ (r.mt[i-1] >> 30)) * 1566083941)) - uint32(i)
		i++
		if i >= 624 {
			r.mt[0] = r.mt[623]
			i = 1
		}
	}
	r.mt[0] = 0x80000000
}

func (r *pyRandom) uint32() uint32 {
	if r.idx >= 624 {
		for kk := 0; kk < 624; kk++ {
			y := (r.mt[kk] & 0x80000000) | (r.mt[(kk+1)%624] & 0x7fffffff)
			v := r.mt[(kk+397)%624] ^ (y >> 1)
			if y&1 != 0 {
				v ^= 0x9908b0df
			}
			r.mt[kk] = v
		}
		r.idx = 0
	}
	y := r.mt[r.idx]
	r.idx++
	y ^= y >> 11
	y ^= (y << 7) & 0x9d2c5680
	y ^= (y << 15) & 0xefc60000
	y ^= y >> 18
	return y
}

// getrandbits for 1 <= k <= 32, as CPython computes it.
func (r *pyRandom) getrandbits(k uint) uint32 {
	return r.uint32() >> (32 - k)
}

// below returns an int in [0, n) the way random._randbelow_with_getrandbits does (n >= 1).
func (r *pyRandom) below(n int) int {
	k := uint(0)
	for v := n; v > 0; v >>= 1 {
		k++
	}
	x := int(r.getrandbits(k))
	for x >= n {
		x = int(r.getrandbits(k))
	}
	return x
}
