import csv, sys, collections
def load(fn):
    ks = {}
    cur = None
    with open(fn) as f:
        r = csv.reader(f)
        hdr = None
        for row in r:
            if row and row[0] == 'Kernel Name':
                cur = row[1]; ks[cur] = []; hdr = None; continue
            if row and row[0] == 'Address':
                hdr = row; continue
            if hdr and row:
                ks[cur].append(dict(zip(hdr, row)))
    return ks
for fn in sys.argv[1:]:
    ks = load(fn)
    for k, rows in ks.items():
        tot = sum(int(r['Instructions Executed'] or 0) for r in rows)
        samp = sum(int(r['Warp Stall Sampling (All Samples)'] or 0) for r in rows)
        op = collections.Counter(); sm = collections.Counter()
        stalls = collections.Counter()
        for r in rows:
            n = int(r['Instructions Executed'] or 0)
            src = r['Source'].strip()
            o = src.split()[0]
            if o.startswith('@'): o = src.split()[1]
            o = o.split('.')[0]
            op[o] += n; sm[o] += int(r['Warp Stall Sampling (All Samples)'] or 0)
            for c in r:
                if c.startswith('stall_') and '(Not' not in c:
                    try: stalls[c] += int(r[c] or 0)
                    except: pass
        print(fn, k[-6:], 'instr', tot, 'samples', samp)
        print('  by op (instr %, samples %):', [(o, round(100*n/tot,1), round(100*sm[o]/max(samp,1),1)) for o,n in op.most_common(16)])
        print('  stalls:', [(s[6:], round(100*v/max(samp,1),1)) for s,v in stalls.most_common(8)])
