"""Which symbols the GPU/NPU programs probe, and the API of each: a named
API matches its one symbol, a pattern API (every aclnn op) a family."""

from mmtrace.bpf import device as device_stream


class ProbedSymbols:
    """The symbols an API table probes. Called with a symbol, says whether
    it is one (discovery's `wanted`); `prefixes` are the two-letter starts
    of every probed name and pattern (cu, ac, __): discovery decodes only
    the names of a file that start so."""

    def __init__(self, table: device_stream.ApiTable):
        self.named = {api.symbol: api for api in table.apis if api.pattern is None}
        self.patterns = [api for api in table.apis if api.pattern is not None]
        starts = {symbol[:2] for symbol in self.named}
        starts |= {api.pattern[:2] for api in self.patterns}
        if any(len(s) < 2 or not s.isidentifier() for s in starts):
            raise ValueError(f"probed names must start with two name characters, got {starts}")
        self.prefixes = tuple(sorted(starts))

    def __call__(self, symbol: str) -> bool:
        return symbol in self.named or any(api.matches(symbol) for api in self.patterns)

    def api_of(self, symbol: str) -> device_stream.Api | None:
        api = self.named.get(symbol)
        if api is not None:
            return api
        return next((p for p in self.patterns if p.matches(symbol)), None)


# For discovery: is a symbol one the built-in table's programs probe?
wanted = ProbedSymbols(device_stream.default_table())
