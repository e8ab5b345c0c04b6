//! A library file is checked before the dynamic loader maps it. The loader trusts the file's
//! program headers: for a truncated copy it maps pages past the end of the file, and the first
//! touch of them kills the whole process with SIGBUS before any error can be printed.

use goblin::elf::program_header::pt_to_str;
use goblin::elf::section_header::SHT_NOBITS;
use goblin::elf::Elf;

/// Why `bytes` (a whole file) cannot be a shared library the loader can map safely.
pub fn check(bytes: &[u8]) -> Result<(), String> {
    let len = bytes.len() as u64;
    let elf = Elf::parse(bytes).map_err(|e| format!("a damaged or truncated ELF file ({len} bytes): {e}"))?;
    if elf.header.e_type != goblin::elf::header::ET_DYN {
        return Err(format!(
            "an ELF file of type {}, not a shared library",
            goblin::elf::header::et_to_str(elf.header.e_type)
        ));
    }
    for (i, segment) in elf.program_headers.iter().enumerate() {
        let end = segment.p_offset.checked_add(segment.p_filesz);
        if end.is_none_or(|end| end > len) {
            return Err(format!(
                "truncated: segment {i} ({}) needs bytes {}..{} but the file has {len}",
                pt_to_str(segment.p_type),
                segment.p_offset,
                segment.p_offset.saturating_add(segment.p_filesz)
            ));
        }
    }
    for section in elf.section_headers.iter().filter(|s| s.sh_type != SHT_NOBITS) {
        let end = section.sh_offset.checked_add(section.sh_size);
        if end.is_none_or(|end| end > len) {
            let name = elf.shdr_strtab.get_at(section.sh_name).unwrap_or("?");
            return Err(format!(
                "truncated: section {name} needs bytes {}..{} but the file has {len}",
                section.sh_offset,
                section.sh_offset.saturating_add(section.sh_size)
            ));
        }
    }
    Ok(())
}
