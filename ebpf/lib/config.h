// SPDX-License-Identifier: GPL-2.0
/* The agent's configuration (the config map's one entry).
 * Part of datapath.bpf.c's one translation unit (see there). */

static __always_inline struct dp_config *get_config(void)
{
	__u32 zero = 0;
	asm volatile("" : : "r"(DP_BUILD_SALT));
	return bpf_map_lookup_elem(&config, &zero);
}
