"""What the host allocator and the paged cache agree on, with no device code: page 0 is the null
page. No row owns it; unused page-table entries point at it, and writes that must land nowhere
(padding columns, idle rows) land in it."""

NULL_PAGE = 0
